//! Decoding a compressed reply as it streams, never past a budget: the
//! decoder writes into a sink that refuses more than the caller has room
//! for (plus one byte, so the caller sees that more was coming), so a
//! reply that inflates a thousandfold stops at the cap, not in memory.

use super::BodyError;
use flate2::write::{DeflateDecoder, MultiGzDecoder, ZlibDecoder};
use reqwest::header::CONTENT_ENCODING;
use reqwest::Response;
use std::io::{self, Write};

/// A decoder of one body.
pub(super) enum Decoder {
    /// Concatenated gzip members decode one after another, as RFC 9110 has it.
    Gzip(MultiGzDecoder<Sink>),
    /// `deflate` as RFC 9110 means it: zlib-wrapped.
    Zlib(ZlibDecoder<Sink>),
    /// `deflate` as some servers send it: raw, without the zlib wrapper.
    Raw(DeflateDecoder<Sink>),
    /// `deflate` before its first two bytes, which tell the two apart.
    Deflate(Vec<u8>),
}

impl Decoder {
    /// The decoder `response`'s `Content-Encoding` needs: `None` for none
    /// (or `identity`), an error naming any encoding not decoded here.
    pub(super) fn for_response(response: &Response) -> Result<Option<Decoder>, BodyError> {
        let mut codings = Vec::new();
        for value in response.headers().get_all(CONTENT_ENCODING) {
            let value = String::from_utf8_lossy(value.as_bytes()).to_ascii_lowercase();
            codings.extend(
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|c| !c.is_empty() && *c != "identity")
                    .map(String::from),
            );
        }
        match codings.as_slice() {
            [] => Ok(None),
            [one] if one == "gzip" || one == "x-gzip" => {
                Ok(Some(Decoder::Gzip(MultiGzDecoder::new(Sink::default()))))
            }
            [one] if one == "deflate" => Ok(Some(Decoder::Deflate(Vec::new()))),
            _ => Err(BodyError::Unsupported(
                super::clip(&codings.join(", "), 100).to_string(),
            )),
        }
    }

    pub(super) fn name(&self) -> &'static str {
        match self {
            Decoder::Gzip(_) => "gzip",
            _ => "deflate",
        }
    }

    /// Decodes `chunk`: at most `room + 1` bytes come out.
    pub(super) fn push(&mut self, chunk: &[u8], room: usize) -> Result<Vec<u8>, BodyError> {
        if let Decoder::Deflate(head) = self {
            head.extend_from_slice(chunk);
            if head.len() < 2 {
                return Ok(Vec::new());
            }
            let head = std::mem::take(head);
            *self = if is_zlib_header(head[0], head[1]) {
                Decoder::Zlib(ZlibDecoder::new(Sink::default()))
            } else {
                Decoder::Raw(DeflateDecoder::new(Sink::default()))
            };
            return self.push(&head, room);
        }
        self.sink().room = room + 1;
        let name = self.name();
        let written = match self {
            Decoder::Gzip(d) => d.write_all(chunk).and_then(|()| d.flush()),
            Decoder::Zlib(d) => d.write_all(chunk).and_then(|()| d.flush()),
            Decoder::Raw(d) => d.write_all(chunk).and_then(|()| d.flush()),
            Decoder::Deflate(_) => unreachable!("resolved above"),
        };
        self.take(written, name)
    }

    /// The rest, once the body has ended: at most `room + 1` bytes.
    pub(super) fn finish(&mut self, room: usize) -> Result<Vec<u8>, BodyError> {
        if let Decoder::Deflate(head) = self {
            if head.is_empty() {
                return Ok(Vec::new());
            }
            // One byte in all: no deflate stream is that short.
            return Err(BodyError::Undecodable {
                encoding: "deflate",
                why: "it ended after one byte".into(),
            });
        }
        self.sink().room = room + 1;
        let name = self.name();
        let finished = match self {
            Decoder::Gzip(d) => d.try_finish(),
            Decoder::Zlib(d) => d.try_finish(),
            Decoder::Raw(d) => d.try_finish(),
            Decoder::Deflate(_) => unreachable!("resolved above"),
        };
        self.take(finished, name)
    }

    fn sink(&mut self) -> &mut Sink {
        match self {
            Decoder::Gzip(d) => d.get_mut(),
            Decoder::Zlib(d) => d.get_mut(),
            Decoder::Raw(d) => d.get_mut(),
            Decoder::Deflate(_) => unreachable!("a sink exists once the kind is known"),
        }
    }

    /// What the sink holds; a write refused because the sink was full is
    /// no error (the caller sees the extra byte), any other is.
    fn take(&mut self, result: io::Result<()>, name: &'static str) -> Result<Vec<u8>, BodyError> {
        let sink = self.sink();
        match result {
            Err(e) if !sink.full => Err(BodyError::Undecodable {
                encoding: name,
                why: e.to_string(),
            }),
            _ => Ok(std::mem::take(&mut sink.bytes)),
        }
    }
}

/// RFC 1950: compression method 8 (deflate), and the two bytes a multiple
/// of 31.
fn is_zlib_header(cmf: u8, flg: u8) -> bool {
    cmf & 0x0f == 8 && (u16::from(cmf) << 8 | u16::from(flg)).is_multiple_of(31)
}

/// Where a decoder writes: takes at most `room` bytes, then refuses.
#[derive(Default)]
pub(super) struct Sink {
    bytes: Vec<u8>,
    room: usize,
    full: bool,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let free = self.room.saturating_sub(self.bytes.len());
        if free == 0 && !buf.is_empty() {
            self.full = true;
            return Err(io::Error::other("the decoded reply passed its cap"));
        }
        let n = buf.len().min(free);
        self.bytes.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
