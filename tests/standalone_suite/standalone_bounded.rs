//! Every byte taken in from a server the user chose is bounded while it
//! streams (issue 18, item 1). The servers here are real, on 127.0.0.1, and
//! generate their 400 MiB replies on the fly (they never hold them).
//!
//! - Through `agents run`, measuring the process's peak RSS (`wait4`'s
//!   `ru_maxrss`): an http tool's 400 MiB streamed reply, one announced by
//!   `Content-Length`, and a 400 MiB error body each fail only their call,
//!   quickly, with a message that says what was wrong; a redirect to another
//!   host is refused, and the secret header never reaches that host; a small
//!   reply still works.
//! - The same for a model endpoint answering 400 MiB: a permanent model
//!   failure that says why, asked once.
//! - At the adapter (`OpenAiModel`): a redirect to another host and a huge
//!   error body.

use crate::support;

use agents::core::{ToolSchema, Turn, UserTurn};
use agents::model::{ModelRequest, OpenAiModel, MAX_MODEL_REPLY_BYTES};
use agents::tools::MAX_REPLY_BYTES;
use std::io::{Read, Write};
use std::process::Child;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::http::{Response, Server};
use support::scratch::*;

const MIB: u64 = 1024 * 1024;
/// What the hostile servers send (or announce).
const HUGE: u64 = 400 * MIB;
/// The peak RSS an `agents run` may reach while refusing [`HUGE`]: far
/// above its working size (some tens of MiB), far below the body.
const PEAK_LIMIT_KIB: u64 = 200 * 1024;

/// What a server saw and sent.
#[derive(Default)]
struct Seen {
    /// (path, headers in lower case) of every request.
    requests: Mutex<Vec<(String, String)>>,
    /// Body bytes written to sockets, over all replies.
    sent: AtomicU64,
}

/// How the server answers a path.
enum Answer {
    /// A small reply.
    Small(u16, &'static str, String),
    /// `HUGE` bytes of `filler`, chunked (no length announced).
    Chunked(u16, &'static str),
    /// `HUGE` bytes of `filler`, announced by `Content-Length`.
    Announced(u16, &'static str),
    /// A redirect to this location.
    Redirect(String),
    /// A small reply in this `Content-Encoding`, its bytes as given.
    Encoded(&'static str, Vec<u8>),
    /// A gzip bomb: 1 MiB on the wire that inflates to 1 GiB of zeros,
    /// chunked.
    GzipBomb,
}

/// A server on 127.0.0.1 answering every request by `route(path)`; one
/// thread per connection.
fn serve(route: impl Fn(&str) -> Answer + Send + Sync + 'static) -> (u16, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let record = seen.clone();
    let server = Server::start(move |req| {
        let headers: String = req
            .headers
            .iter()
            .map(|(k, v)| format!("{k}: {v}\r\n").to_ascii_lowercase())
            .collect();
        record
            .requests
            .lock()
            .unwrap()
            .push((req.path.clone(), headers));
        answer(route(&req.path), record.clone())
    });
    (server.port, seen)
}

fn answer(answer: Answer, seen: Arc<Seen>) -> Response {
    let bomb_seen = seen.clone();
    // 64 KiB of filler, written until the total or until the peer hangs up.
    let filler = move |out: &mut dyn Write| {
        let filler = vec![b'x'; 64 * 1024];
        let mut left = HUGE;
        while left > 0 {
            let n = left.min(filler.len() as u64) as usize;
            out.write_all(&filler[..n])?;
            seen.sent.fetch_add(n as u64, Ordering::Relaxed);
            left -= n as u64;
        }
        Ok(())
    };
    match answer {
        Answer::Small(status, content_type, body) => {
            Response::new(status, body).header("Content-Type", content_type)
        }
        Answer::Chunked(status, content_type) => {
            Response::stream(status, true, filler).header("Content-Type", content_type)
        }
        Answer::Announced(status, content_type) => Response::stream(status, false, filler)
            .header("Content-Type", content_type)
            .header("Content-Length", HUGE.to_string()),
        Answer::Redirect(location) => Response::new(307, "").header("Location", location),
        Answer::Encoded(encoding, body) => Response::new(200, body)
            .header("Content-Type", "application/json")
            .header("Content-Encoding", encoding),
        Answer::GzipBomb => {
            let bomb = move |out: &mut dyn Write| {
                let (head, block, tail) = gzip_bomb_parts();
                out.write_all(&head)?;
                for _ in 0..BOMB_BLOCKS {
                    out.write_all(&block)?;
                    bomb_seen
                        .sent
                        .fetch_add(block.len() as u64, Ordering::Relaxed);
                }
                out.write_all(&tail)
            };
            Response::stream(200, true, bomb)
                .header("Content-Type", "application/json")
                .header("Content-Encoding", "gzip")
        }
    }
}

/// Blocks of [`gzip_bomb_parts`] in the bomb: each inflates to 1 MiB.
const BOMB_BLOCKS: usize = 1024;

/// A gzip stream of 1 GiB of zeros in three parts: the gzip header, a
/// deflate block run that inflates to 1 MiB (about 1 KiB of it, repeated
/// [`BOMB_BLOCKS`] times: each run ends on a byte boundary and refers
/// only to zeros), and the final block with the trailer (CRC-32 and size).
fn gzip_bomb_parts() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    use flate2::write::DeflateEncoder;
    let zeros = vec![0u8; MIB as usize];
    let mut encoder = DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(&zeros).unwrap();
    encoder.flush().unwrap(); // a sync flush: non-final blocks, byte-aligned
    let block = encoder.get_ref().clone();
    let head = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 255];
    let mut one = flate2::Crc::new();
    one.update(&zeros);
    let mut all = flate2::Crc::new();
    for _ in 0..BOMB_BLOCKS {
        all.combine(&one);
    }
    // The final block: fixed Huffman codes, end of block only.
    let mut tail = vec![0x03, 0x00];
    tail.extend_from_slice(&all.sum().to_le_bytes());
    tail.extend_from_slice(&all.amount().to_le_bytes());
    (head, block, tail)
}

fn compressed(json: &str, gzip: bool) -> Vec<u8> {
    let level = flate2::Compression::default();
    if gzip {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), level);
        e.write_all(json.as_bytes()).unwrap();
        e.finish().unwrap()
    } else {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), level);
        e.write_all(json.as_bytes()).unwrap();
        e.finish().unwrap()
    }
}

/// A finished `agents` process: what it printed, its peak RSS and how long
/// it took.
struct Measured {
    run: Run,
    peak_kib: u64,
    elapsed: Duration,
}

/// Waits for `child` with `wait4`, which reports its peak resident set
/// (`ru_maxrss`, in KiB on Linux) exactly, however briefly it peaked.
fn measure(mut child: Child, args: &[&str]) -> Measured {
    let start = Instant::now();
    let pipe = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let stdout = pipe(Box::new(child.stdout.take().unwrap()));
    let stderr = pipe(Box::new(child.stderr.take().unwrap()));
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: plain syscall on our own child; `usage` is written by the kernel.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4: {}", std::io::Error::last_os_error());
    let elapsed = start.elapsed();
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    Measured {
        run: Run {
            code,
            stdout: stdout.join().unwrap(),
            stderr: stderr.join().unwrap(),
            args: args.join(" "),
        },
        peak_kib: usage.ru_maxrss as u64,
        elapsed,
    }
}

fn assert_bounded(m: &Measured, what: &str) {
    eprintln!(
        "{what}: peak RSS {} MiB in {:?}",
        m.peak_kib / 1024,
        m.elapsed
    );
    assert!(
        m.peak_kib < PEAK_LIMIT_KIB,
        "{what}: `agents run` peaked at {} MiB (limit {} MiB) against a {} MiB reply",
        m.peak_kib / 1024,
        PEAK_LIMIT_KIB / 1024,
        HUGE / MIB
    );
    assert!(
        m.elapsed < Duration::from_secs(60),
        "{what}: took {:?}",
        m.elapsed
    );
}

#[test]
fn http_tool_replies_are_bounded_while_they_stream() {
    let (other, other_seen) = serve(|_| Answer::Small(200, "text/plain", "stolen".into()));
    let (port, seen) = serve(move |path| match path {
        "/stream" => Answer::Chunked(200, "application/json"),
        "/announced" => Answer::Announced(200, "text/plain"),
        "/error" => Answer::Chunked(500, "text/html"),
        // 127.0.0.1 and localhost: one machine, two hosts.
        "/redirect" => Answer::Redirect(format!("http://localhost:{other}/collect")),
        _ => Answer::Small(200, "application/json", r#"{"ok": true}"#.into()),
    });
    let s = Scratch::new("bounded-http");
    let tool = |name: &str, path: &str| {
        format!(
            r#"
      - name: {name}
        http:
          url: "http://127.0.0.1:{port}/{path}"
          headers:
            - name: X-Api-Key
              valueFrom: {{secretKeyRef: {{name: svc, key: token}}}}"#
        )
    };
    let tools: String = [
        ("stream", "stream"),
        ("announced", "announced"),
        ("error", "error"),
        ("redirect", "redirect"),
        ("small", "small"),
    ]
    .iter()
    .map(|(n, p)| tool(n, p))
    .collect();
    let file = s.write(
        "bounded.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: hostile}}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: stream, arguments: {{}}}}
              - {{name: announced, arguments: {{}}}}
              - {{name: error, arguments: {{}}}}
              - {{name: redirect, arguments: {{}}}}
              - {{name: small, arguments: {{}}}}
          - text: survived
    tools:{tools}
"#
        ),
    );
    let args = ["run", "-f", &file.display().to_string()];
    let child = s
        .cmd(&args)
        .env("AGENTS_SECRET_SVC_TOKEN", "s3cret-token")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let m = measure(child, &args);
    let out = m.run.ok().to_string();
    assert!(out.contains("answer: survived"), "{out}");
    assert_bounded(&m, "http tools");
    // Far less was sent than offered: reading stopped at the cap (the
    // rest is what loopback buffers took in before the hang-up).
    let sent = seen.sent.load(Ordering::Relaxed);
    assert!(sent < 100 * MIB, "the servers sent {} MiB", sent / MIB);

    let shown = s.run(&["session", "show", "hostile"]);
    let shown = shown.ok();
    let result = |call: &str| {
        shown
            .lines()
            .find(|l| l.contains(&format!("result {call} ")))
            .unwrap_or_else(|| panic!("no result {call}:\n{shown}"))
            .to_string()
    };
    let streamed = result("t1-c0");
    assert!(
        streamed.contains(&format!(
            "error: POST http://127.0.0.1:{port}/stream sent a reply of more than {MAX_REPLY_BYTES} bytes (8 MiB), the most an http tool's reply may hold"
        )) && streamed.contains("Have the tool answer with less"),
        "{streamed}"
    );
    let announced = result("t1-c1");
    assert!(
        announced.contains(&format!(
            "announced a reply of {HUGE} bytes (Content-Length), more than the {MAX_REPLY_BYTES} bytes (8 MiB) an http tool's reply may hold; none of it was read"
        )),
        "{announced}"
    );
    let error = result("t1-c2");
    assert!(
        error.contains("answered 500 Internal Server Error: xxxx") && error.ends_with("… (cut)"),
        "{error}"
    );
    assert!(error.len() < 1000, "a short excerpt: {} bytes", error.len());
    let redirect = result("t1-c3");
    assert!(
        redirect.contains(&format!(
            "answered 307 Temporary Redirect, a redirect to \"http://localhost:{other}/collect\", which was not followed"
        )) && redirect.contains("set the URL to the final address"),
        "{redirect}"
    );
    assert!(
        other_seen.requests.lock().unwrap().is_empty(),
        "the other host was asked"
    );
    assert!(result("t1-c4").contains(r#"{"ok":true}"#), "{shown}");
    // The tool's secret went only where it was meant to go.
    let requests = seen.requests.lock().unwrap();
    assert_eq!(requests.len(), 5, "one request per call");
    assert!(requests
        .iter()
        .all(|(_, h)| h.contains("x-api-key: s3cret-token")));
}

#[test]
fn compressed_http_tool_replies_are_decoded_within_the_cap_or_refused() {
    let (port, seen) = serve(|path| match path {
        "/gzip" => Answer::Encoded("gzip", compressed(r#"{"unzipped": 1}"#, true)),
        "/deflate" => Answer::Encoded("deflate", compressed(r#"{"inflated": 2}"#, false)),
        "/bomb" => Answer::GzipBomb,
        "/br" => Answer::Encoded("br", vec![0x8b, 0x02, 0x80, b'{', b'}', 0x03]),
        _ => Answer::Small(200, "text/plain", "?".into()),
    });
    let s = Scratch::new("compressed-http");
    let tools: String = ["gzip", "deflate", "bomb", "br"]
        .iter()
        .map(|n| {
            format!("\n      - name: {n}\n        http: {{url: \"http://127.0.0.1:{port}/{n}\"}}")
        })
        .collect();
    let file = s.write(
        "compressed.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: squeezed}}
spec:
  messages: ["go"]
  agent:
    model:
      provider: scripted
      scripted:
        replies:
          - toolCalls:
              - {{name: gzip, arguments: {{}}}}
              - {{name: deflate, arguments: {{}}}}
              - {{name: bomb, arguments: {{}}}}
              - {{name: br, arguments: {{}}}}
          - text: survived
    tools:{tools}
"#
        ),
    );
    let args = ["run", "-f", &file.display().to_string()];
    let child = s
        .cmd(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let m = measure(child, &args);
    assert!(m.run.ok().contains("answer: survived"), "{}", m.run.stdout);
    assert_bounded(&m, "compressed http tools");
    // Decoding stopped at the cap: 8 MiB decoded is 8 KiB of the bomb sent
    // (and what loopback buffers took in before the hang-up).
    let sent = seen.sent.load(Ordering::Relaxed);
    assert!(sent < 16 * MIB, "the bomb sent {} MiB", sent / MIB);

    let shown = s.run(&["session", "show", "squeezed"]);
    let shown = shown.ok();
    let result = |call: &str| {
        shown
            .lines()
            .find(|l| l.contains(&format!("result {call} ")))
            .unwrap_or_else(|| panic!("no result {call}:\n{shown}"))
            .to_string()
    };
    assert!(result("t1-c0").contains(r#"{"unzipped":1}"#), "{shown}");
    assert!(result("t1-c1").contains(r#"{"inflated":2}"#), "{shown}");
    let bomb = result("t1-c2");
    assert!(
        bomb.contains(&format!(
            "error: POST http://127.0.0.1:{port}/bomb sent a gzip-compressed reply of more than {MAX_REPLY_BYTES} bytes (8 MiB) once decoded (or as sent), the most an http tool's reply may hold; decoding stopped there"
        )),
        "{bomb}"
    );
    let br = result("t1-c3");
    assert!(
        br.contains(
            r#"the reply is encoded as "br" (Content-Encoding), which is not decoded here"#
        ),
        "{br}"
    );
    // Replies are asked for uncompressed.
    let requests = seen.requests.lock().unwrap();
    assert_eq!(requests.len(), 4, "one request per call");
    assert!(
        requests
            .iter()
            .all(|(_, h)| h.contains("accept-encoding: identity\r\n")),
        "{requests:?}"
    );
}

#[test]
fn a_model_reply_is_bounded_while_it_streams_and_not_asked_again() {
    let (port, seen) = serve(|_| Answer::Chunked(200, "application/json"));
    let s = Scratch::new("bounded-model");
    let file = s.write(
        "model.yaml",
        &format!(
            r#"
apiVersion: agents-exe.io/v1alpha1
kind: Session
metadata: {{name: chatty}}
spec:
  messages: ["hello"]
  agent:
    model:
      provider: openai
      openai: {{baseUrl: "http://127.0.0.1:{port}/v1", model: m}}
"#
        ),
    );
    let args = ["run", "-f", &file.display().to_string()];
    let m = measure(s.spawn(&args), &args);
    assert_bounded(&m, "model");
    assert_eq!(m.run.code, 1, "the session fails:\n{}", m.run.stdout);
    let want = format!(
        "POST http://127.0.0.1:{port}/v1/chat/completions answered 200 OK but sent a reply of more than {MAX_MODEL_REPLY_BYTES} bytes (4 MiB), the most a model reply may hold"
    );
    let shown = s.run(&["session", "show", "chatty"]);
    assert!(shown.ok().contains(&want), "{}", shown.stdout);
    assert!(
        shown.stdout.contains("it is not retried"),
        "{}",
        shown.stdout
    );
    assert_eq!(
        seen.requests.lock().unwrap().len(),
        1,
        "a permanent failure is not re-asked (nor re-billed)"
    );
    let sent = seen.sent.load(Ordering::Relaxed);
    assert!(sent < 100 * MIB, "the server sent {} MiB", sent / MIB);
}

fn ask_once(port: u16) -> Result<agents::core::AgentTurn, agents::model::ModelError> {
    ask_once_within(port, None)
}

/// One request from a client held to the model URL allow-list `allowed`.
fn ask_once_within(
    port: u16,
    allowed: Option<&[&str]>,
) -> Result<agents::core::AgentTurn, agents::model::ModelError> {
    use agents::http::allow::{AllowedUrls, Purpose};
    let list = allowed.map(|p| Arc::new(AllowedUrls::parse_for(Purpose::Models, p).unwrap()));
    let model = OpenAiModel::new(
        &format!("http://127.0.0.1:{port}/v1"),
        "m",
        Some("sk-test-123".into()),
        Duration::from_secs(30),
    )
    .with_allowed_urls(list);
    let turns = vec![Turn::User(UserTurn {
        message: Some("hi".into()),
        tool_results: vec![],
    })];
    let tools: Vec<ToolSchema> = vec![];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(model.reply(&ModelRequest {
        system_prompt: "",
        turns: &turns,
        tools: &tools,
    }))
}

#[test]
fn a_model_endpoint_cannot_redirect_the_key_to_another_host() {
    let (other, other_seen) = serve(|_| Answer::Small(200, "application/json", "{}".into()));
    let (port, seen) =
        serve(move |_| Answer::Redirect(format!("http://localhost:{other}/v1/chat/completions")));
    let e = ask_once(port).unwrap_err();
    assert!(!e.retryable, "{e:?}");
    assert!(
        e.message.contains(&format!(
            "answered 307 Temporary Redirect, a redirect to \"http://localhost:{other}/v1/chat/completions\", which was not followed"
        )) && e.message.contains("check spec.model.openai.baseUrl"),
        "{e}"
    );
    assert!(other_seen.requests.lock().unwrap().is_empty());
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
}

#[test]
fn a_model_off_the_operators_list_is_sent_nothing() {
    let reply = r#"{"choices":[{"message":{"role":"assistant","content":"hi"}}]}"#;
    let (port, seen) = serve(move |path| match path {
        "/v1/chat/completions" => Answer::Redirect("/elsewhere/chat/completions".into()),
        _ => Answer::Small(200, "application/json", reply.into()),
    });
    // Off the list: refused before any request, for good, saying why.
    let e = ask_once_within(port, Some(&["http://127.0.0.1:1/*"])).unwrap_err();
    assert!(!e.retryable, "{e:?}");
    assert!(
        e.message.starts_with(&format!(
            "\"http://127.0.0.1:{port}/v1/chat/completions\" is not on the operator's allow-list \
             of URLs models may be called at (--model-allowed-urls, chart value \
             operator.modelAllowedUrls)"
        )) && e.message.contains("check spec.model.openai.baseUrl"),
        "{e}"
    );
    assert!(seen.requests.lock().unwrap().is_empty());
    // On the list, but redirected to a path off it: not followed.
    let listed = format!("http://127.0.0.1:{port}/v1/*");
    let e = ask_once_within(port, Some(&[listed.as_str()])).unwrap_err();
    assert!(e.message.contains("which was not followed"), "{e}");
    assert_eq!(seen.requests.lock().unwrap().len(), 1);
    // A redirect within the list is followed.
    let whole = format!("http://127.0.0.1:{port}/*");
    let turn = ask_once_within(port, Some(&[whole.as_str()])).unwrap();
    assert_eq!(turn.text.as_deref(), Some("hi"));
    let paths: Vec<String> = seen
        .requests
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.0.clone())
        .collect();
    assert_eq!(
        paths[1..],
        ["/v1/chat/completions", "/elsewhere/chat/completions"]
    );
}

#[test]
fn a_huge_model_error_body_is_read_only_in_part() {
    let (port, _) = serve(|_| Answer::Announced(503, "text/html"));
    let started = Instant::now();
    let e = ask_once(port).unwrap_err();
    assert!(e.retryable, "a 503 stays retryable: {e:?}");
    assert!(
        e.message.contains("503 Service Unavailable; body: \"xxxx")
            && e.message
                .contains("(more than 65536 bytes in all, the first 200 shown)"),
        "{e}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // And a huge 200 with its length announced is refused unread.
    let (port, seen) = serve(|_| Answer::Announced(200, "application/json"));
    let e = ask_once(port).unwrap_err();
    assert!(!e.retryable, "{e:?}");
    assert!(
        e.message.contains(&format!(
            "announced a reply of {HUGE} bytes (Content-Length), more than the {MAX_MODEL_REPLY_BYTES} bytes (4 MiB) a model reply may hold; none of it was read"
        )),
        "{e}"
    );
    let sent = seen.sent.load(Ordering::Relaxed);
    assert!(sent < 100 * MIB, "the server sent {} MiB", sent / MIB);
}
