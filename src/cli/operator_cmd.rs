//! `agents operator`.

use super::OperatorArgs;
use crate::http::allow::{AllowedUrls, Purpose};
use std::process::ExitCode;
use std::sync::Arc;

pub fn run(args: OperatorArgs) -> anyhow::Result<ExitCode> {
    // Logs are set up in `cli::main` (RUST_LOG, default info; AGENTS_LOG_FORMAT=json).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut job_defaults = crate::runner::job::JobDefaults {
        service_account: args.tool_service_account,
        allowed_images: (!args.allowed_tool_images.is_empty()).then_some(args.allowed_tool_images),
        ttl_seconds_after_finished: args.job_ttl_seconds_after_finished,
        ..Default::default()
    };
    job_defaults.limits.insert("cpu".into(), args.job_cpu_limit);
    job_defaults
        .limits
        .insert("memory".into(), args.job_memory_limit);
    let http_tool_allowed_urls = allow_list(Purpose::HttpTools, &args.http_tool_allowed_urls)?;
    let model_allowed_urls = allow_list(Purpose::Models, &args.model_allowed_urls)?;
    let metrics_addr = args.metrics_addr.parse().map_err(|e| {
        anyhow::anyhow!(
            "--metrics-addr {:?} is not an address like 0.0.0.0:8080: {e}",
            args.metrics_addr
        )
    })?;
    runtime.block_on(crate::operator::run(crate::operator::Options {
        namespaces: args.namespaces,
        agents_image: args.agents_image,
        job_defaults,
        default_tool_timeout_secs: args.job_active_deadline_seconds,
        model_timeout_secs: args.model_timeout_seconds,
        leader_election: args.leader_elect.then(|| crate::operator::LeaseOptions {
            name: args.lease_name,
            duration: std::time::Duration::from_secs(args.lease_duration_seconds),
            grace: std::time::Duration::from_secs(args.lease_grace_seconds),
        }),
        metrics_addr,
        resync: std::time::Duration::from_secs(args.resync_seconds),
        resync_rate: args.resync_rate,
        stall_bound: std::time::Duration::from_secs(args.stall_seconds),
        max_concurrent_reconciles: args.max_concurrent_reconciles,
        max_reconciles_per_namespace: args.max_reconciles_per_namespace,
        max_background_runs_per_namespace: args.max_background_runs_per_namespace,
        api_rate: (args.api_qps > 0).then(|| crate::operator::ApiRate {
            qps: args.api_qps,
            burst: args.api_burst.unwrap_or(args.api_qps.saturating_mul(2)),
        }),
        event_pace: crate::operator::event_sink::EventPace {
            qps: args.event_qps,
            burst: args.event_burst,
        },
        max_calls_per_reply: args.max_calls_per_reply,
        secrets_need_label: args.secrets_need_label,
        finished_session_ttl_seconds: args.finished_session_ttl_seconds,
        http_tool_allowed_urls,
        model_allowed_urls,
        notify_webhook_url: args.notify_webhook_url.filter(|u| !u.is_empty()),
        approvals_page_url: args.approvals_page_url.filter(|u| !u.is_empty()),
        max_sub_agent_depth: args.max_sub_agent_depth,
    }))?;
    Ok(ExitCode::SUCCESS)
}

/// The operator's list for `purpose` from its flag's patterns; none given:
/// no list (any URL).
fn allow_list(purpose: Purpose, patterns: &[String]) -> anyhow::Result<Option<Arc<AllowedUrls>>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let list = AllowedUrls::parse_for(purpose, patterns)
        .map_err(|e| anyhow::anyhow!("{}: {e}", purpose.flag()))?;
    Ok(Some(Arc::new(list)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_list_names_its_own_flag_and_none_means_any_url() {
        assert!(allow_list(Purpose::Models, &[]).unwrap().is_none());
        let e = allow_list(Purpose::Models, &["ftp://x/*".into()]).unwrap_err();
        assert!(e.to_string().starts_with("--model-allowed-urls: "), "{e}");
        let e = allow_list(Purpose::HttpTools, &["ftp://x/*".into()]).unwrap_err();
        assert!(
            e.to_string().starts_with("--http-tool-allowed-urls: "),
            "{e}"
        );
        let list = allow_list(Purpose::Models, &["https://api.openai.com/v1/*".into()])
            .unwrap()
            .unwrap();
        assert!(list.allows_str("https://api.openai.com/v1/chat/completions"));
        assert!(!list.allows_str("http://10.0.0.1/v1/chat/completions"));
    }
}
