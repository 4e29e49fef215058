//! The store's file on disk: refused early when it, or a file SQLite keeps
//! beside it, is no regular file; its directory; whether it may be written;
//! its `file:` URI for read-only opens.

use crate::store::StoreError;
use crate::store::StoreResult;
use std::path::{Path, PathBuf};

/// The files SQLite keeps beside a database, by suffix.
pub(super) const SIDE_FILES: [&str; 3] = ["-wal", "-shm", "-journal"];

/// Refuses a store whose path, or a file SQLite keeps beside it, exists
/// and is no regular file, before SQLite opens any: a FIFO would block the
/// open for ever, and a directory in place of `-wal` or `-shm` fails later
/// as a bare "disk I/O error" or as a read-only store, neither of which
/// names the culprit. Symbolic links are followed, as SQLite follows them.
pub(super) fn regular_files(path: &Path) -> StoreResult<()> {
    let display = path.display().to_string();
    let unusable = |why: String| StoreError::Unusable {
        path: display.clone(),
        why,
    };
    if let Some(kind) = not_a_regular_file(path) {
        return Err(unusable(format!(
            "it is {kind}, not a file; give the path of a store file (or of a new one) with \
             --store sqlite:PATH"
        )));
    }
    for suffix in SIDE_FILES {
        let mut side = path.as_os_str().to_owned();
        side.push(suffix);
        let side = PathBuf::from(side);
        if let Some(kind) = not_a_regular_file(&side) {
            return Err(unusable(format!(
                "{} is {kind}, where SQLite keeps a file of the store ({suffix}); move it \
                 out of the way (SQLite creates the file itself)",
                side.display()
            )));
        }
    }
    Ok(())
}

/// What `path` is, when it exists and is not a regular file.
pub(super) fn not_a_regular_file(path: &Path) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let kind = std::fs::metadata(path).ok()?.file_type();
    let what = if kind.is_file() {
        return None;
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "no regular file"
    };
    Some(what)
}

/// The directory holding `path` (`.` for a bare file name).
pub(super) fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether this process may write `path` (access(2): mode bits, ACLs, a
/// read-only mount; root passes the mode bits).
pub(super) fn writable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated string for the call's duration.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// A `file:` URI for a read-only open; characters URIs reserve are escaped.
pub(super) fn file_uri(path: &Path, immutable: bool) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut uri = String::from("file:");
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            uri.push(b as char);
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri.push_str(if immutable {
        "?immutable=1"
    } else {
        "?mode=ro"
    });
    uri
}
