//! A loopback HTTP/1.1 server for tests: a handler closure turns each
//! request into a response, on a thread per connection (one request per
//! connection, `Connection: close`). Every request is recorded before the
//! handler sees it.
//!
//! ```ignore
//! let server = Server::start(|req| Response::json(200, format!("{{\"path\":\"{}\"}}", req.path)));
//! // ... point the product at server.url("/v1") ...
//! assert_eq!(server.requests().len(), 1);
//! ```

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

/// One request as the server read it.
#[derive(Clone, Debug)]
pub struct Request {
    pub method: String,
    /// The path; an absolute target (`http://host/path`, as sent to a
    /// proxy) is reduced to its path.
    pub path: String,
    /// Header names as sent, values trimmed.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as JSON, `Null` when it is not JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// Writes a streamed body.
pub type Writer = Box<dyn FnOnce(&mut dyn Write) -> std::io::Result<()> + Send>;

pub enum Body {
    /// Sent with its `Content-Length`.
    Bytes(Vec<u8>),
    /// Written as it is made: chunked (`Transfer-Encoding: chunked`, one
    /// chunk per write), or raw (then the length is whatever the
    /// response's headers say, or the connection's end).
    Stream { chunked: bool, write: Writer },
    /// No answer at all: the connection is held until the client closes it.
    Hang,
    /// No answer: the connection is closed at once.
    Close,
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Body,
}

impl Response {
    /// `status` with `body` and no Content-Type.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Response {
        Response {
            status,
            headers: vec![],
            body: Body::Bytes(body.into()),
        }
    }

    /// `status` with a JSON `body`.
    pub fn json(status: u16, body: impl Into<Vec<u8>>) -> Response {
        Response::new(status, body).header("Content-Type", "application/json")
    }

    /// `status` with a `text/plain` body.
    pub fn text(status: u16, body: impl Into<Vec<u8>>) -> Response {
        Response::new(status, body).header("Content-Type", "text/plain")
    }

    /// `status` with a body written by `write` (see [`Body::Stream`]).
    pub fn stream(
        status: u16,
        chunked: bool,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<()> + Send + 'static,
    ) -> Response {
        Response {
            status,
            headers: vec![],
            body: Body::Stream {
                chunked,
                write: Box::new(write),
            },
        }
    }

    /// Never answers (see [`Body::Hang`]).
    pub fn hang() -> Response {
        Response {
            status: 0,
            headers: vec![],
            body: Body::Hang,
        }
    }

    /// Closes the connection without answering.
    pub fn close() -> Response {
        Response {
            status: 0,
            headers: vec![],
            body: Body::Close,
        }
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Response {
        self.headers.push((name.to_string(), value.into()));
        self
    }
}

type Handler = dyn Fn(&Request) -> Response + Send + Sync;

/// A server on 127.0.0.1; it runs as long as the test process does.
pub struct Server {
    pub port: u16,
    requests: Arc<Mutex<Vec<Request>>>,
}

impl Server {
    pub fn start(handler: impl Fn(&Request) -> Response + Send + Sync + 'static) -> Server {
        Server::start_keeping(handler, true)
    }

    /// A server that records each request without its body: for tests whose
    /// bodies add up to more than a test should hold (long conversations).
    #[allow(dead_code)]
    pub fn start_without_bodies(
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
    ) -> Server {
        Server::start_keeping(handler, false)
    }

    fn start_keeping(
        handler: impl Fn(&Request) -> Response + Send + Sync + 'static,
        bodies: bool,
    ) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests: Arc<Mutex<Vec<Request>>> = Arc::default();
        let handler: Arc<Handler> = Arc::new(handler);
        let record = requests.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (record, handler) = (record.clone(), handler.clone());
                std::thread::spawn(move || serve(stream, &*handler, &record, bodies));
            }
        });
        Server { port, requests }
    }

    /// `http://127.0.0.1:PORT` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Every request so far, in the order they were read.
    pub fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut first = String::new();
    if reader.read_line(&mut first).unwrap_or(0) == 0 {
        return None;
    }
    let mut parts = first.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("/");
    let path = match target.strip_prefix("http://") {
        Some(rest) => rest.find('/').map(|i| &rest[i..]).unwrap_or("/"),
        None => target,
    }
    .to_string();
    let (mut headers, mut length) = (Vec::new(), 0usize);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        if line == "\r\n" || line == "\n" {
            break;
        }
        if let Some((k, v)) = line.trim_end().split_once(':') {
            let (k, v) = (k.trim().to_string(), v.trim().to_string());
            if k.eq_ignore_ascii_case("content-length") {
                length = v.parse().unwrap_or(0);
            }
            headers.push((k, v));
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Request {
        method,
        path,
        headers,
        body,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        307 => "Temporary Redirect",
        401 => "Unauthorized",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "X",
    }
}

fn serve(stream: TcpStream, handler: &Handler, record: &Mutex<Vec<Request>>, bodies: bool) {
    let mut reader = BufReader::new(stream);
    let Some(request) = read_request(&mut reader) else {
        return;
    };
    let mut kept = request.clone();
    if !bodies {
        kept.body = Vec::new();
    }
    record.lock().unwrap().push(kept);
    let response = handler(&request);
    let mut out = reader.into_inner();
    let mut head = format!(
        "HTTP/1.1 {} {}\r\n",
        response.status,
        reason(response.status)
    );
    for (k, v) in &response.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    match response.body {
        Body::Bytes(body) => {
            head.push_str(&format!(
                "Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            ));
            let _ = out.write_all(head.as_bytes());
            let _ = out.write_all(&body);
        }
        Body::Stream { chunked, write } => {
            if chunked {
                head.push_str("Transfer-Encoding: chunked\r\n");
            }
            head.push_str("Connection: close\r\n\r\n");
            if out.write_all(head.as_bytes()).is_err() {
                return;
            }
            if chunked {
                if write(&mut Chunked(&mut out)).is_ok() {
                    let _ = out.write_all(b"0\r\n\r\n");
                }
            } else {
                let _ = write(&mut out);
            }
        }
        Body::Hang => {
            let mut sink = [0u8; 256];
            while matches!(out.read(&mut sink), Ok(n) if n > 0) {}
        }
        Body::Close => {}
    }
}

/// Frames each write as one chunk.
struct Chunked<'a>(&'a mut TcpStream);

impl Write for Chunked<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        write!(self.0, "{:x}\r\n", buf.len())?;
        self.0.write_all(buf)?;
        self.0.write_all(b"\r\n")?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}
