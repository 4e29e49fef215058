//! Logs: set up once, for every command. `RUST_LOG` filters (default:
//! warnings for the CLI, whose output is the progress lines; the operator
//! asks for `info`), `AGENTS_LOG_FORMAT=json` gives one JSON object per
//! line. Logs go to stderr, so stdout stays the command's output.

use tracing_subscriber::EnvFilter;

pub fn init(default_level: &str, json_flag: bool) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    let json = json_flag
        || std::env::var("AGENTS_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second init (tests calling in-process) keeps the first.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
