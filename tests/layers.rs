//! The direction of imports (DESIGN.md, "Layers and the direction of
//! imports"): an arrow only points down. This test parses every file in
//! `src/` with `syn` and reads every `use` item, every path in code and
//! types, and the paths in macro bodies and serde attributes. It resolves
//! `self::` and `super::` chains to the module they name, and fails on a
//! `crate::` path that points up or on an outside crate a layer may not use.
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
//!
//! A bare relative path (`child::Item`) can only name a child module of the
//! file's own module, so it stays inside its top-level module (at the crate
//! root every module may be named): the test leaves those alone.
//!
//! The binary also holds `core_is_pure` (tests/layers/core_is_pure.rs).

#[path = "layers/core_is_pure.rs"]
mod core_is_pure;

use proc_macro2::{Spacing, TokenStream, TokenTree};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use syn::spanned::Spanned;
use syn::visit::{self, Visit};

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

/// What a layer may use outside the crate: `only` (when set) lists every
/// outside crate it may name at all; `never` lists paths it must not use.
struct OutsideRule {
    only: Option<&'static [&'static str]>,
    never: &'static [&'static str],
    why: &'static str,
}

fn outside_rule(module: &str) -> OutsideRule {
    match module {
        // thiserror: the core's error types derive their messages with it
        // (no I/O); schemars: the stored document's schema is derived from
        // the core types (issue 28, item 2).
        "core" => OutsideRule {
            only: Some(&[
                "std",
                "core",
                "alloc",
                "serde",
                "serde_json",
                "sha2",
                "glob",
                "schemars",
                "thiserror",
            ]),
            never: &[
                "std::fs",
                "std::net",
                "std::process",
                "std::thread",
                "std::env",
                "std::time::SystemTime",
                "std::time::Instant",
            ],
            why: "the core is pure: no I/O, no clock, no runtime",
        },
        "engine" => OutsideRule {
            only: None,
            never: &["kube", "reqwest", "std::fs", "std::env"],
            why: "the engine does its I/O through ports; drivers and adapters own the rest",
        },
        _ => OutsideRule {
            only: None,
            never: &[],
            why: "",
        },
    }
}

/// Known violations, each waiting on the issue named beside it: the test
/// passes over these (file under `src/`, rule) and fails on any other, and
/// also once one of these is gone, so that its entry goes too.
const KNOWN: &[(&str, &str)] = &[];

/// One arrow against the layers: the rule it breaks (`crate::cli`,
/// `std::env`, `tokio`), and a message saying what to do.
#[derive(Debug)]
struct Violation {
    rule: String,
    message: String,
}

/// A path as written (segments) and the line it starts on.
struct Written {
    line: usize,
    segments: Vec<String>,
    leading_colon: bool,
}

/// Collects every path of a file, keeping the module it was written in.
struct Collector {
    module: Vec<String>,
    paths: Vec<(Vec<String>, Written)>,
    /// Names this file declares or imports from the crate: a path starting
    /// with one is ours even when an outside crate has the same name.
    local: BTreeSet<String>,
}

impl Collector {
    fn push(&mut self, line: usize, segments: Vec<String>, leading_colon: bool) {
        let written = Written {
            line,
            segments,
            leading_colon,
        };
        self.paths.push((self.module.clone(), written));
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        self.local.insert(item.ident.to_string());
        self.module.push(item.ident.to_string());
        visit::visit_item_mod(self, item);
        self.module.pop();
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let mut leaves = Vec::new();
        use_paths(&item.tree, &mut Vec::new(), &mut leaves);
        for (line, segments) in leaves {
            let ours = matches!(segments[0].as_str(), "crate" | "self" | "super");
            if ours {
                self.local.insert(segments.last().unwrap().clone());
            }
            self.push(line, segments, item.leading_colon.is_some());
        }
    }

    fn visit_item_extern_crate(&mut self, item: &'ast syn::ItemExternCrate) {
        if item.ident != "self" {
            let line = item.ident.span().start().line;
            self.push(line, vec![item.ident.to_string()], true);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 || path.leading_colon.is_some() {
            let line = path.span().start().line;
            self.push(line, segments, path.leading_colon.is_some());
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        let mut found = Vec::new();
        paths_in_tokens(mac.tokens.clone(), &mut found);
        for (line, segments) in found {
            self.push(line, segments, false);
        }
    }

    fn visit_attribute(&mut self, attr: &'ast syn::Attribute) {
        // `#[serde(with = "crate::x")]` and the like name code in strings.
        if attr.path().is_ident("serde") || attr.path().is_ident("schemars") {
            if let syn::Meta::List(list) = &attr.meta {
                paths_in_strings(list.tokens.clone(), self);
            }
        }
        visit::visit_attribute(self, attr);
    }
}

/// Every leaf of a `use` tree as a full path: `use a::{b, c::{self, d}}`
/// gives `a::b`, `a::c` and `a::c::d`; a glob gives its parent.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(usize, Vec<String>)>) {
    let leaf = |prefix: &Vec<String>, ident: &syn::Ident| {
        let mut path = prefix.clone();
        if ident != "self" || prefix.is_empty() {
            path.push(ident.to_string());
        }
        (ident.span().start().line, path)
    };
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => out.push(leaf(prefix, &n.ident)),
        syn::UseTree::Rename(r) => out.push(leaf(prefix, &r.ident)),
        syn::UseTree::Glob(g) => {
            if !prefix.is_empty() {
                out.push((g.star_token.spans[0].start().line, prefix.clone()));
            }
        }
        syn::UseTree::Group(g) => {
            for item in &g.items {
                use_paths(item, prefix, out);
            }
        }
    }
}

/// Paths (`a::b`, at least two segments) in a macro's tokens. Tokens, not
/// text: a string literal is one token, so nothing in it counts.
fn paths_in_tokens(tokens: TokenStream, out: &mut Vec<(usize, Vec<String>)>) {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let colon2 = |at: usize| match (trees.get(at), trees.get(at + 1)) {
        (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b))) => {
            a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':'
        }
        _ => false,
    };
    let mut i = 0;
    while i < trees.len() {
        match &trees[i] {
            TokenTree::Group(g) => paths_in_tokens(g.stream(), out),
            TokenTree::Ident(first) => {
                let mut path = vec![first.to_string()];
                while colon2(i + 1) {
                    let Some(TokenTree::Ident(next)) = trees.get(i + 3) else {
                        break;
                    };
                    path.push(next.to_string());
                    i += 3;
                }
                if path.len() > 1 {
                    out.push((first.span().start().line, path));
                }
            }
            _ => {}
        }
        i += 1;
    }
}

/// Paths named by string literals in an attribute's tokens.
fn paths_in_strings(tokens: TokenStream, collector: &mut Collector) {
    for tree in tokens {
        match tree {
            TokenTree::Group(g) => paths_in_strings(g.stream(), collector),
            TokenTree::Literal(lit) => {
                let Ok(syn::Lit::Str(s)) = syn::parse_str::<syn::Lit>(&lit.to_string()) else {
                    continue;
                };
                if let Ok(path) = syn::parse_str::<syn::Path>(&s.value()) {
                    let segments: Vec<String> =
                        path.segments.iter().map(|s| s.ident.to_string()).collect();
                    if segments.len() > 1 {
                        let line = lit.span().start().line;
                        collector.push(line, segments, path.leading_colon.is_some());
                    }
                }
            }
            _ => {}
        }
    }
}

/// What a written path names.
#[derive(Debug, PartialEq)]
enum Target {
    /// A top-level module of this crate (or an item at its root).
    Crate(String),
    /// An outside crate, with the whole path (`std::env::var`).
    Outside(Vec<String>),
    /// Something local to the module, or a type's associated item.
    Local,
}

/// Resolve `crate::`, `self::` and `super::` chains against `module` (the
/// path from the crate root to where the path was written).
fn resolve(
    module: &[String],
    written: &Written,
    outside: &BTreeSet<String>,
    local: &BTreeSet<String>,
) -> Result<Target, String> {
    let seg = &written.segments;
    let first = seg[0].as_str();
    if written.leading_colon {
        return Ok(Target::Outside(seg.clone()));
    }
    let absolute: Vec<String> = match first {
        "crate" => seg[1..].to_vec(),
        "self" => module.iter().chain(&seg[1..]).cloned().collect(),
        "super" => {
            let ups = seg.iter().take_while(|s| *s == "super").count();
            if ups > module.len() {
                return Err(format!(
                    "`{}` goes {ups} modules up from `crate::{}`, past the crate root",
                    seg.join("::"),
                    module.join("::")
                ));
            }
            let base = &module[..module.len() - ups];
            base.iter().chain(&seg[ups..]).cloned().collect()
        }
        _ if outside.contains(first) && !local.contains(first) => {
            return Ok(Target::Outside(seg.clone()))
        }
        _ => return Ok(Target::Local),
    };
    Ok(match absolute.first() {
        Some(top) => Target::Crate(top.clone()),
        None => Target::Local,
    })
}

/// `src/engine/holder.rs` -> (`engine`, [engine, holder]); the crate roots
/// `lib.rs` and `main.rs` are their own layers.
fn place(rel: &str) -> (String, Vec<String>) {
    let stem = rel.trim_end_matches(".rs");
    if stem == "lib" || stem == "main" {
        return (stem.to_string(), Vec::new());
    }
    let mut module: Vec<String> = stem.split('/').map(str::to_string).collect();
    if module.last().is_some_and(|m| m == "mod") {
        module.pop();
    }
    (module[0].clone(), module)
}

/// Every arrow against the layers in one file (`rel`: its path under
/// `src/`, with `/`); `Err` when the file does not parse.
fn check_file(rel: &str, text: &str, outside: &BTreeSet<String>) -> Result<Vec<Violation>, String> {
    let ast = syn::parse_file(text).map_err(|e| {
        let at = e.span().start();
        format!("src/{rel}:{}:{}: does not parse: {e}", at.line, at.column)
    })?;
    let (layer, module) = place(rel);
    let mut collector = Collector {
        module,
        paths: Vec::new(),
        local: BTreeSet::new(),
    };
    collector.visit_file(&ast);
    let mut found = Vec::new();
    for (module, written) in &collector.paths {
        let target = resolve(module, written, outside, &collector.local)
            .map_err(|e| format!("src/{rel}:{}: {e}", written.line))?;
        if let Some(v) = judge(&layer, rel, written, target) {
            found.push(v);
        }
    }
    Ok(found)
}

/// The violation, if any, of `layer` naming `target`.
fn judge(layer: &str, rel: &str, written: &Written, target: Target) -> Option<Violation> {
    let line = written.line;
    match target {
        Target::Local => None,
        Target::Crate(top) => {
            (top != layer && !allowed(layer).contains(&top.as_str())).then(|| Violation {
                rule: format!("crate::{top}"),
                message: format!(
                    "src/{rel}:{line}: {layer} uses crate::{top} (`{}`), which is not below it",
                    written.segments.join("::")
                ),
            })
        }
        Target::Outside(path) => outside_violation(layer, rel, line, &path),
    }
}

fn outside_violation(layer: &str, rel: &str, line: usize, path: &[String]) -> Option<Violation> {
    let rule = outside_rule(layer);
    let full = path.join("::");
    if let Some(only) = rule.only {
        if !only.contains(&path[0].as_str()) {
            return Some(Violation {
                rule: path[0].clone(),
                message: format!(
                    "src/{rel}:{line}: {layer} uses the outside crate `{}` (`{full}`); \
                     it may use only {} ({})",
                    path[0],
                    only.join(", "),
                    rule.why
                ),
            });
        }
    }
    let banned = rule.never.iter().find(|never| {
        let prefix: Vec<&str> = never.split("::").collect();
        path.len() >= prefix.len() && path.iter().zip(&prefix).all(|(a, b)| a == b)
    })?;
    Some(Violation {
        rule: banned.to_string(),
        message: format!(
            "src/{rel}:{line}: {layer} uses `{full}`: no `{banned}` in the {layer} ({})",
            rule.why
        ),
    })
}

/// The names of outside crates: the standard library's and every
/// dependency in Cargo.toml (`-` read as `_`).
fn outside_crates(manifest: &str) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = ["std", "core", "alloc", "proc_macro"]
        .into_iter()
        .map(String::from)
        .collect();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_end_matches(']');
            let table = header.split('.').next().unwrap_or("");
            in_deps = table.ends_with("dependencies");
            if let Some(name) = header
                .strip_prefix(&format!("{table}."))
                .filter(|_| in_deps)
            {
                names.insert(name.replace('-', "_"));
                in_deps = false;
            }
            continue;
        }
        let key = line.split('=').next().unwrap_or("").trim();
        if in_deps && !key.is_empty() && !key.starts_with('#') {
            names.insert(key.replace('-', "_"));
        }
    }
    names
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

#[test]
fn every_import_points_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // AGENTS_LAYERS_SRC: check another tree (an older checkout, say).
    let src = match std::env::var_os("AGENTS_LAYERS_SRC") {
        Some(dir) => PathBuf::from(dir),
        None => root.join("src"),
    };
    let manifest = std::fs::read_to_string(src.join("../Cargo.toml")).unwrap();
    let outside = outside_crates(&manifest);
    let mut files = Vec::new();
    sources(&src, &mut files);
    let (mut wrong, mut known_seen, mut seen) = (Vec::new(), BTreeSet::new(), BTreeSet::new());
    for file in &files {
        let rel = file
            .strip_prefix(&src)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        seen.insert(place(&rel).0);
        let text = std::fs::read_to_string(file).unwrap();
        for v in check_file(&rel, &text, &outside).unwrap_or_else(|e| panic!("{e}")) {
            match KNOWN.iter().find(|(f, r)| *f == rel && *r == v.rule) {
                Some(known) => {
                    known_seen.insert(*known);
                }
                None => wrong.push(v.message),
            }
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
    let gone: Vec<_> = KNOWN.iter().filter(|k| !known_seen.contains(*k)).collect();
    assert!(
        gone.is_empty(),
        "known violations no longer found, remove them from KNOWN in tests/layers.rs: {gone:?}"
    );
}

#[test]
fn the_checker_sees_an_upward_import() {
    let found = rules(
        "engine/step.rs",
        "use crate::standalone::progress::Progress; // crate::cli\n",
    );
    assert_eq!(found, ["crate::standalone"]);
    assert!(!allowed("engine").contains(&"standalone"));
    assert!(!allowed("operator").contains(&"standalone"));
    assert!(!allowed("standalone").contains(&"operator"));
    assert!(!allowed("store").contains(&"engine"));
}

/// The rules `text`, as the file `rel` under `src/`, breaks.
fn rules(rel: &str, text: &str) -> Vec<String> {
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
    let outside = outside_crates(&manifest.unwrap());
    let found = check_file(rel, text, &outside).unwrap_or_else(|e| panic!("{e}"));
    found.into_iter().map(|v| v.rule).collect()
}

// The four misses of the text scan this test replaced (issue 28, item 5).

#[test]
fn a_grouped_import_is_read_leaf_by_leaf() {
    let text = "use crate::{core::Phase, standalone::progress::{self, Progress}};\n\
                use crate::{ports::{Store}, {cli::Cli}};\n";
    let found = rules("engine/step.rs", text);
    assert_eq!(
        found,
        ["crate::standalone", "crate::standalone", "crate::cli"]
    );
    assert_eq!(
        rules("engine/step.rs", "use crate::{core, ports::*};"),
        [""; 0]
    );
}

#[test]
fn a_super_chain_resolves_to_the_module_it_names() {
    // src/engine/a/b.rs is crate::engine::a::b: three `super`s reach the root.
    let found = rules(
        "engine/a/b.rs",
        "use super::super::super::cli::Cli;\n\
         use super::super::holder::Fence;\n\
         fn f() { super::super::super::operator::run(); }\n\
         mod inner { use super::super::super::super::standalone::Driver; }\n",
    );
    assert_eq!(
        found,
        ["crate::cli", "crate::operator", "crate::standalone"]
    );
    let manifest = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
    let past_root = check_file(
        "engine/mod.rs",
        "use super::super::x;",
        &outside_crates(&manifest.unwrap()),
    );
    assert!(past_root.unwrap_err().contains("past the crate root"));
}

#[test]
fn a_path_after_a_string_with_slashes_is_read_and_strings_are_not() {
    let text = "fn f() { let url = \"http://x\"; crate::cli::run(url); }\n\
                fn g() -> &'static str { \"crate::operator\" } // crate::operator\n\
                fn h() { tracing::info!(\"a // b\", x = ?crate::standalone::X); }\n";
    assert_eq!(
        rules("engine/step.rs", text),
        ["crate::cli", "crate::standalone"]
    );
}

#[test]
fn outside_crates_are_checked_per_layer() {
    let core = "use tokio::time::sleep;\n\
                use serde::{Deserialize, Serialize};\n\
                fn now() -> std::time::Instant { todo!() }\n\
                #[derive(Serialize)] #[serde(with = \"reqwest::x\")] struct S;\n";
    assert_eq!(
        rules("core/time.rs", core),
        ["tokio", "std::time::Instant", "reqwest"]
    );
    let engine = "use std::{env, fs::read_to_string};\n\
                  fn c() -> kube::Client { reqwest::get(\"u\"); todo!() }\n\
                  use crate::store::kube::KubeStore;\n";
    assert_eq!(
        rules("engine/step.rs", engine),
        ["std::env", "std::fs", "kube", "reqwest", "crate::store"]
    );
    // A module of ours that shares a crate's name is ours.
    assert_eq!(rules("engine/mod.rs", "mod kube; use kube::X;"), [""; 0]);
    // Other layers may use what they need.
    assert_eq!(
        rules("store/kube.rs", "use kube::Api; use std::env;"),
        [""; 0]
    );
}
