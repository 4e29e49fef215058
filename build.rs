//! Stamps the binary with its commit and build date for `agents version`
//! and `--version`: AGENTS_GIT_COMMIT and AGENTS_BUILD_DATE.
//!
//! The commit is `AGENTS_GIT_COMMIT` when set (a build from a tarball or
//! in the Dockerfile, where `.git` is left out, can pass it), else what
//! `git rev-parse` says, else "unknown". The date honours
//! `SOURCE_DATE_EPOCH` (reproducible builds), else it is now, in UTC.

use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=AGENTS_GIT_COMMIT");
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
    let commit = std::env::var("AGENTS_GIT_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".into());
    watch_git_head();
    println!("cargo:rustc-env=AGENTS_GIT_COMMIT={}", commit.trim());
    println!("cargo:rustc-env=AGENTS_BUILD_DATE={}", build_date());
}

/// Output of `git ARGS` in the package folder, if git runs and succeeds.
fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

/// The checked-out commit, 12 hex digits.
fn git_commit() -> Option<String> {
    git(&["rev-parse", "--short=12", "HEAD"])
}

/// Rebuild the stamp when HEAD moves (a commit, a checkout): watch HEAD,
/// the branch's ref and packed-refs. Only paths that exist are named: a
/// missing one would make cargo rerun the script on every build.
fn watch_git_head() {
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    let paths = ["HEAD", "packed-refs"].into_iter().chain(branch.as_deref());
    for path in paths {
        if let Some(file) = git(&["rev-parse", "--path-format=absolute", "--git-path", path]) {
            if std::path::Path::new(&file).exists() {
                println!("cargo:rerun-if-changed={file}");
            }
        }
    }
}

/// RFC 3339 UTC time of the build (seconds).
fn build_date() -> String {
    let secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0)
        });
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Year, month, day of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`): no date crate for one line of output.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}
