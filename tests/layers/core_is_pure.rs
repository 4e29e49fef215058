//! The core must stay free of I/O: no kube, tokio, HTTP or database crates,
//! no files, sockets, processes or clocks. This test reads its sources.

use std::fs;
use std::path::Path;

const FORBIDDEN: [&str; 14] = [
    "kube",
    "k8s_openapi",
    "tokio",
    "reqwest",
    "hyper",
    "rusqlite",
    "sqlx",
    "std::fs",
    "std::net",
    "std::process",
    "std::thread",
    "SystemTime",
    "Instant",
    "std::env",
];

#[test]
fn the_core_imports_no_io() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut checked = 0;
    for path in sources(&dir) {
        let text = fs::read_to_string(&path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN {
                let hit = code
                    .match_indices(word)
                    .any(|(i, _)| !code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_'));
                assert!(
                    !hit,
                    "{}:{}: the core must not use `{word}` (I/O belongs in adapters): {line}",
                    path.display(),
                    n + 1
                );
            }
        }
        checked += 1;
    }
    assert!(checked >= 8, "expected the core's modules, found {checked}");
}

/// The `.rs` files under `dir`, submodules included.
fn sources(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}
