//! The direction of imports (DESIGN.md, "Layers and the direction of
//! imports"): an arrow only points down. This test reads every `crate::`
//! path in `src/` (comments skipped) and fails on one that points up.
//!
//! ```text
//!   cli                                   (the surface)
//!   operator | standalone                 (drivers; never each other)
//!   lease, observe                        (the operator's infrastructure)
//!   engine | agent                        (know no driver)
//!   store, runner, model, tools,          (adapters: ports, never the engine)
//!   telemetry, host
//!   ports                                 (traits and records; core types only)
//!   api                                   (CRD types and their mapping)
//!   core                                  (pure)
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every top-level module, bottom layer first.
const ORDER: &[&str] = &[
    "core",
    "api",
    "ports",
    "http",
    "model",
    "tools",
    "store",
    "runner",
    "telemetry",
    "host",
    "engine",
    "agent",
    "lease",
    "observe",
    "operator",
    "standalone",
    "cli",
    "lib",
    "main",
];

/// What each top-level module may import (besides itself).
fn allowed(module: &str) -> &'static [&'static str] {
    const ADAPTER: &[&str] = &["core", "api", "ports", "http", "model", "tools"];
    let below = |m: &str| &ORDER[..ORDER.iter().position(|o| *o == m).unwrap()];
    match module {
        "core" => &[],
        "api" => &["core"],
        // The ports speak core types only: no CRD type (and so no
        // Kubernetes derive) reaches the engine through them.
        "ports" => &["core"],
        "http" => &[],
        "model" | "tools" => &["core", "ports", "http"],
        "store" | "runner" => ADAPTER,
        "telemetry" | "host" => &["core", "ports"],
        "engine" => &["core", "ports"],
        "agent" => &["core", "api", "ports", "http", "model", "tools"],
        "lease" | "observe" => &["core", "ports", "engine"],
        // The drivers: everything below them but each other.
        "operator" => below("operator"),
        "standalone" => &[
            "core",
            "api",
            "ports",
            "http",
            "model",
            "tools",
            "store",
            "runner",
            "telemetry",
            "host",
            "engine",
            "agent",
        ],
        "cli" | "lib" | "main" => below(module),
        other => panic!("src/{other}: a module this test does not place; add it to a layer"),
    }
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to: `src/engine/holder.rs` -> engine.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel
        .components()
        .next()
        .unwrap()
        .as_os_str()
        .to_string_lossy();
    first.trim_end_matches(".rs").to_string()
}

/// The modules named by `crate::<module>` in the code of `text`.
fn imports(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let code = line.split("//").next().unwrap_or("");
        for (i, _) in code.match_indices("crate::") {
            if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$') {
                continue;
            }
            let rest = &code[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push((n + 1, name));
            }
        }
    }
    out
}

#[test]
fn every_import_points_down() {
    // AGENTS_LAYERS_SRC: check another tree (an older checkout, say).
    let src = match std::env::var_os("AGENTS_LAYERS_SRC") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    };
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut wrong = Vec::new();
    let mut seen = BTreeSet::new();
    for file in &files {
        let module = module_of(&src, file);
        seen.insert(module.clone());
        let text = std::fs::read_to_string(file).unwrap();
        for (line, target) in imports(&text) {
            if target == module || allowed(&module).contains(&target.as_str()) {
                continue;
            }
            wrong.push(format!(
                "{}:{line}: {module} imports crate::{target}, which is not below it",
                file.display()
            ));
        }
    }
    assert!(
        seen.contains("core") && seen.contains("operator"),
        "{seen:?}"
    );
    assert!(
        wrong.is_empty(),
        "imports against the layers:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_checker_sees_an_upward_import() {
    let found = imports("use crate::standalone::progress::Progress; // crate::cli\n");
    assert_eq!(found, vec![(1, "standalone".to_string())]);
    assert!(!allowed("engine").contains(&"standalone"));
    assert!(!allowed("operator").contains(&"standalone"));
    assert!(!allowed("standalone").contains(&"operator"));
    assert!(!allowed("store").contains(&"engine"));
}
