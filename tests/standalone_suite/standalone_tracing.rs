//! OpenTelemetry traces from `agents run` and `agents session resume`,
//! read back from a real OpenTelemetry Collector (`tests/cluster/build
//! otelcol`; no cluster needed): the two processes of one session make one
//! trace, the resumed step linked to the first; a bad endpoint is a
//! warning and a run without traces; a collector that is not there never
//! holds up a run.
//!
//! Skipped when the collector cannot be had, unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use support::launcher::free_port;
use support::otel::{tree, Collector};
use support::scratch::{Run, Scratch};

const FLOW: &str = r#"
apiVersion: agents-exe.io/v1alpha1
kind: Agent
metadata: {name: helper}
spec:
  model:
    provider: scripted
    scripted:
      replies:
        - toolCalls:
            - {name: lookup, arguments: {what: now}}
            - {name: ask, arguments: {question: "the answer?"}}
        - text: both are in
  tools:
    - {name: lookup, builtin: {function: echo}}
    - {name: ask, builtin: {function: echo}}
  policy:
    default: runSync
    rules:
      - {tool: ask, disposition: defer, reason: a person answers}
---
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {name: traced}
spec:
  agentRef: {name: helper}
  messages: ["look it up and ask"]
"#;

fn run_with(scratch: &Scratch, env: &[(&str, String)], args: &[&str]) -> Run {
    let mut cmd = scratch.cmd(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Run::from(cmd.output().expect("agents runs"), args)
}

#[test]
fn a_session_across_two_processes_is_one_trace_with_a_link() {
    let Some(collector) = Collector::start("standalone") else {
        return;
    };
    let scratch = Scratch::new("trace");
    scratch.write("flow.yaml", FLOW);
    let env = collector.env();
    let first = run_with(&scratch, &env, &["run", "-f", "flow.yaml"]);
    assert!(first.ok().contains("traced-t1-c1"), "{}", first.stdout);
    run_with(
        &scratch,
        &env,
        &["session", "complete", "traced-t1-c1", "--text", "42"],
    )
    .ok();
    let resumed = run_with(&scratch, &env, &["session", "resume", "traced"]);
    assert!(resumed.ok().contains("both are in"), "{}", resumed.stdout);
    // Each process flushed its spans as it ended; the collector writes
    // them within its batch and flush intervals.
    let spans = collector.wait_for("both steps and their children", |s| s.len() >= 6);
    println!("{}", tree(&spans));

    let traces: BTreeSet<&str> = spans.iter().map(|s| s.trace_id.as_str()).collect();
    assert_eq!(traces.len(), 1, "one trace:\n{}", tree(&spans));
    let conversations: BTreeSet<Option<&str>> = spans
        .iter()
        .map(|s| s.attr("gen_ai.conversation.id"))
        .collect();
    assert_eq!(conversations.len(), 1, "{conversations:?}");
    assert!(conversations
        .iter()
        .all(|c| c.is_some_and(|c| !c.is_empty())));
    let mut steps: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "invoke_agent helper")
        .collect();
    steps.sort_by_key(|s| s.start_ns);
    assert_eq!(steps.len(), 2, "one step per process:\n{}", tree(&spans));
    assert_eq!(steps[0].resource["service.name"], "agents");
    assert!(steps[0].links.is_empty());
    assert_eq!(
        steps[1].links,
        [(steps[0].trace_id.clone(), steps[0].span_id.clone())]
    );
    let names: Vec<(&str, &str, Option<&str>)> = {
        let mut v: Vec<_> = spans.iter().filter(|s| !s.parent.is_empty()).collect();
        v.sort_by_key(|s| s.start_ns);
        v.iter()
            .map(|s| {
                let parent = if s.parent == steps[0].span_id {
                    "first"
                } else {
                    "resumed"
                };
                (s.name.as_str(), parent, s.attr("agents.result.source"))
            })
            .collect()
    };
    assert_eq!(
        names,
        [
            ("chat scripted", "first", None),
            ("execute_tool lookup", "first", Some("executed")),
            ("execute_tool ask", "resumed", Some("outside")),
            ("chat scripted", "resumed", None),
        ],
        "{}",
        tree(&spans)
    );
    assert!(
        !collector.raw().contains("gen_ai.tool.call.result"),
        "no content unless asked"
    );
}

#[test]
fn a_bad_endpoint_is_a_warning_and_an_absent_collector_holds_nothing_up() {
    let scratch = Scratch::new("trace-bad");
    scratch.write("flow.yaml", FLOW);
    let bad = [("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318".to_string())];
    let run = run_with(&scratch, &bad, &["run", "-f", "flow.yaml"]);
    run.ok();
    assert!(
        run.stderr.contains("OpenTelemetry tracing is off")
            && run
                .stderr
                .contains("OTEL_EXPORTER_OTLP_ENDPOINT=\"collector:4318\""),
        "{}",
        run.stderr
    );
    // Nothing listens there: the run and its exit are as quick as ever.
    let absent = [
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", free_port()),
        ),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()),
    ];
    let started = Instant::now();
    run_with(
        &scratch,
        &absent,
        &["session", "complete", "traced-t1-c1", "--text", "42"],
    )
    .ok();
    let resumed = run_with(&scratch, &absent, &["session", "resume", "traced"]);
    assert!(resumed.ok().contains("both are in"), "{}", resumed.stdout);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
}
