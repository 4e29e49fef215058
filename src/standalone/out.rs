//! Output that never crashes the process. `println!` panics when stdout is
//! a closed pipe (`agents run -f s.yaml | head -1`); a panic in the middle
//! of a drive would stop the engine between two writes. These functions
//! drop what cannot be written instead: the work goes on, the output is
//! simply not wanted any more.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `text` and a newline to stdout. After a first failed write
/// (EPIPE or any other error) stdout is taken as closed and later output
/// is skipped.
pub fn line(text: &str) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, text, true);
}

/// Writes `text` to stdout as is (no newline added); same rules as [`line`].
pub fn text(text: &str) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, text, false);
}

/// Writes `text` and a newline to stderr; write errors are ignored.
pub fn err_line(text: &str) {
    write_to(&mut std::io::stderr().lock(), &STDERR_CLOSED, text, true);
}

/// True once a write to stdout failed.
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

fn write_to(w: &mut impl Write, closed: &AtomicBool, text: &str, newline: bool) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    let written = w
        .write_all(text.as_bytes())
        .and_then(|_| if newline { w.write_all(b"\n") } else { Ok(()) })
        // Line by line, so a reader sees progress as it happens.
        .and_then(|_| w.flush());
    if written.is_err() {
        closed.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken(usize);

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_broken_pipe_is_remembered_and_later_lines_are_skipped() {
        let closed = AtomicBool::new(false);
        let mut w = Broken(0);
        write_to(&mut w, &closed, "one", true);
        assert!(closed.load(Ordering::Relaxed));
        write_to(&mut w, &closed, "two", true);
        assert_eq!(w.0, 1, "no write is tried after the first failure");
        let mut ok = Vec::new();
        write_to(&mut ok, &AtomicBool::new(false), "fine", true);
        assert_eq!(ok, b"fine\n");
    }
}
