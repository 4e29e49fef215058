//! Every YAML under `examples/` runs with `agents run` and, completed the
//! way its pending calls ask (approve, run-isolated, complete), succeeds.

use crate::support;

use support::scratch::*;

#[test]
fn every_example_runs_to_its_answer() {
    let mut files: Vec<_> = std::fs::read_dir(repo_file("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for file in files {
        let s = Scratch::new("example");
        let run = s.run(&["run", "-f", &file.display().to_string(), "-o", "json"]);
        let mut last = run.ok().lines().last().unwrap_or_default().to_string();
        for _ in 0..5 {
            let event: serde_json::Value = serde_json::from_str(&last).unwrap();
            match event["event"].as_str() {
                Some("finished") => break,
                Some("yielded") => {}
                other => panic!("{}: unexpected end {other:?}: {last}", file.display()),
            }
            let session = event["session"].as_str().unwrap().to_string();
            for p in event["pending"].as_array().unwrap() {
                let token = p["token"].as_str().unwrap();
                match p["waitingFor"].as_str().unwrap() {
                    "approval" => s.run(&["session", "approve", token]).ok(),
                    "isolated" => s.run(&["session", "run-isolated", &session]).ok(),
                    _ => s.run(&["session", "complete", token, "--text", "ok"]).ok(),
                };
            }
            let resumed = s.run(&["session", "resume", &session, "-o", "json"]);
            last = resumed.ok().lines().last().unwrap_or_default().to_string();
        }
        assert!(
            last.contains("\"event\":\"finished\""),
            "{}: {last}",
            file.display()
        );
    }
}
