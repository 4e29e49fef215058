//! OpenTelemetry traces of the engine's steps, for both drivers.
//!
//! Off by default. On when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and configured by the standard
//! variables as the OpenTelemetry SDK reads them: `OTEL_SERVICE_NAME`,
//! `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER(_ARG)`,
//! `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS` and `..._TIMEOUT`, `OTEL_BSP_*`
//! (the batch queue), `OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER=none`.
//! The exporter speaks OTLP over HTTP/protobuf only (port 4318).
//! `AGENTS_TRACE_CONTENT=true` adds tool arguments and results to spans.
//!
//! A bad setting is a warning and a run without traces, never a failure.
//! Spans leave through a bounded queue on the SDK's own thread: a slow or
//! absent collector never holds up a step (full queue: spans are dropped).

mod otel;

use crate::ports::{NoTraces, TracePort};
use std::sync::OnceLock;
use tracing::{info, warn};

pub use otel::OtelTraces;

/// Opts in to tool arguments and results in spans.
pub const CONTENT_ENV: &str = "AGENTS_TRACE_CONTENT";

/// What the environment asks for, once checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceSettings {
    /// Where spans go, as the variable that set it says.
    pub endpoint: String,
    /// `service.name` unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` name one.
    pub default_service: Option<String>,
    pub record_content: bool,
}

/// Reads the settings from `env`: `Ok(None)` when tracing is off,
/// `Err` (what is wrong, for a warning) when a setting cannot work.
pub fn settings_from(
    env: impl Fn(&str) -> Option<String>,
    service: &str,
) -> Result<Option<TraceSettings>, String> {
    let var = |name: &str| {
        env(name)
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    match var("OTEL_TRACES_EXPORTER").as_deref() {
        None | Some("otlp") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(format!(
                "OTEL_TRACES_EXPORTER={other:?} is not supported; this build exports with otlp only"
            ))
        }
    }
    let endpoint = [
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
    ]
    .iter()
    .find_map(|name| var(name).map(|v| (*name, v)));
    let Some((name, endpoint)) = endpoint else {
        return Ok(None);
    };
    check_endpoint(name, &endpoint)?;
    check_protocol(&var)?;
    let named = var("OTEL_SERVICE_NAME").is_some()
        || var("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    Ok(Some(TraceSettings {
        endpoint,
        default_service: (!named).then(|| service.to_string()),
        record_content: record_content(var(CONTENT_ENV).as_deref()),
    }))
}

fn check_endpoint(name: &str, endpoint: &str) -> Result<(), String> {
    let url = reqwest::Url::parse(endpoint).map_err(|e| {
        format!("{name}={endpoint:?} is not a URL ({e}); give one like http://collector:4318")
    })?;
    let http = matches!(url.scheme(), "http" | "https");
    if !http || url.host_str().is_none_or(str::is_empty) {
        return Err(format!(
            "{name}={endpoint:?} is not an http(s) URL with a host; give one like http://collector:4318"
        ));
    }
    Ok(())
}

fn check_protocol(var: &impl Fn(&str) -> Option<String>) -> Result<(), String> {
    for name in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        match var(name).as_deref() {
            None | Some("http/protobuf") => {}
            Some(other) => {
                return Err(format!(
                    "{name}={other:?} is not supported; this build speaks OTLP over http/protobuf only (the collector's port 4318)"
                ))
            }
        }
    }
    Ok(())
}

/// `AGENTS_TRACE_CONTENT`: true, 1, yes (any case) opt in; anything else
/// records no content (a value that is not a clear no gets a warning).
fn record_content(value: Option<&str>) -> bool {
    let Some(v) = value else { return false };
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => true,
        "false" | "0" | "no" => false,
        _ => {
            warn!("{CONTENT_ENV}={v:?} is neither true nor false; tool arguments and results stay out of spans");
            false
        }
    }
}

static TRACES: OnceLock<OtelTraces> = OnceLock::new();

/// Where the drivers' steps send their spans: the installed exporter, or
/// nowhere.
pub fn tracer() -> &'static dyn TracePort {
    match TRACES.get() {
        Some(t) => t,
        None => &NoTraces,
    }
}

/// Flushes and stops the exporter when dropped (at the end of `main`).
#[must_use = "dropping it stops the exporter"]
pub struct Telemetry {
    installed: bool,
}

impl Telemetry {
    /// No tracing for this process.
    pub fn off() -> Telemetry {
        Telemetry { installed: false }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let (true, Some(t)) = (self.installed, TRACES.get()) {
            t.shutdown();
        }
    }
}

/// Sets tracing up from the process environment for a process that calls
/// itself `service` (unless `OTEL_SERVICE_NAME` says otherwise). Once per
/// process; a second call keeps the first exporter.
pub fn install_from_env(service: &str) -> Telemetry {
    let settings = match settings_from(|name| std::env::var(name).ok(), service) {
        Ok(Some(s)) => s,
        Ok(None) => return Telemetry { installed: false },
        Err(why) => {
            warn!("OpenTelemetry tracing is off: {why}");
            return Telemetry::off();
        }
    };
    if TRACES.get().is_some() {
        return Telemetry::off();
    }
    match OtelTraces::new(&settings) {
        Ok(t) => {
            info!(endpoint = %settings.endpoint, content = settings.record_content, "exporting OpenTelemetry traces");
            let installed = TRACES.set(t).is_ok();
            Telemetry { installed }
        }
        Err(why) => {
            warn!("OpenTelemetry tracing is off: {why}");
            Telemetry::off()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> Result<Option<TraceSettings>, String> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        settings_from(|name| env.get(name).cloned(), "agents-test")
    }

    #[test]
    fn tracing_is_off_without_an_endpoint_or_when_disabled() {
        assert_eq!(settings(&[]), Ok(None));
        assert_eq!(settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]), Ok(None));
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")];
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(settings(&[on[0], off]), Ok(None), "{off:?}");
        }
    }

    #[test]
    fn either_endpoint_turns_tracing_on_with_the_default_service_name() {
        for name in [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ] {
            let s = settings(&[(name, "https://otel.example:4318/")])
                .unwrap()
                .unwrap();
            assert_eq!(s.endpoint, "https://otel.example:4318/");
            assert_eq!(s.default_service.as_deref(), Some("agents-test"));
            assert!(!s.record_content, "content is opt-in");
        }
        let named = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SERVICE_NAME", "mine"),
            (CONTENT_ENV, "TRUE"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(named.default_service, None, "OTEL_SERVICE_NAME wins");
        assert!(named.record_content);
    }

    #[test]
    fn a_setting_that_cannot_work_is_refused_with_what_to_give() {
        for (vars, says) in [
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
                "not an http(s) URL",
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "not a url")],
                "is not a URL",
            ),
            (
                vec![("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://")],
                "is not a URL",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ],
                "http/protobuf only",
            ),
            (
                vec![
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                    ("OTEL_TRACES_EXPORTER", "zipkin"),
                ],
                "otlp only",
            ),
        ] {
            let err = settings(&vars).unwrap_err();
            assert!(err.contains(says), "{vars:?}: {err}");
        }
    }

    #[test]
    fn content_needs_a_clear_yes() {
        for (v, on) in [
            ("true", true),
            ("1", true),
            ("Yes", true),
            ("false", false),
            ("0", false),
            ("maybe", false),
        ] {
            assert_eq!(record_content(Some(v)), on, "{v}");
        }
        assert!(!record_content(None));
    }
}
