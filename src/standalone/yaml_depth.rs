//! A bound on how deeply a YAML (or JSON) text nests, checked in one pass
//! before the text reaches the parser: the parser refuses more than 128
//! levels too, but only after it has read every event of the document, in
//! time that grows faster than the file (100,000 levels took over a minute).
//!
//! The scan is a small YAML lexer, not a parser. It counts:
//! - flow collections: `[` and `{` open a level, `]` and `}` close one
//!   (outside quoted scalars and comments);
//! - block collections: a `- ` entry or a `key:` opens a level at its
//!   column; a later line at a smaller column closes the levels to its
//!   right. A sequence written at its parent key's column is a level of
//!   its own, as YAML reads it;
//! - block scalars (`|`, `>`) are skipped, so text in them counts nothing.
//!
//! Where YAML is ambiguous to so small a lexer it counts high rather than
//! low; a file it miscounts still parses if it is within the limit.

/// The deepest nesting a definition file may have: the YAML parser's own
/// limit, so nothing it would take is refused here.
pub const MAX_DEPTH: usize = 128;

/// Where a text first nests deeper than [`MAX_DEPTH`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TooDeep {
    /// 1-based.
    pub line: usize,
}

impl std::fmt::Display for TooDeep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "line {}: nested more than {MAX_DEPTH} levels deep (lists and mappings within \
             each other), the most a definition may nest; the file was not parsed. Flatten \
             it: no agent definition needs so deep a structure (a deeply nested value can \
             go in as a JSON string)",
            self.line
        )
    }
}

/// Checks that `text` nests at most [`MAX_DEPTH`] levels; linear in its
/// length.
pub fn check(text: &str) -> Result<(), TooDeep> {
    let mut scan = Scan::default();
    for (i, line) in text.lines().enumerate() {
        scan.line(line.as_bytes())
            .map_err(|Deeper| TooDeep { line: i + 1 })?;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Seq,
    Map,
}

/// The limit was passed.
struct Deeper;

#[derive(Default)]
struct Scan {
    /// Open block collections, by column, innermost last.
    blocks: Vec<(usize, Kind)>,
    /// Open flow collections.
    flow: usize,
    /// Inside a quoted scalar that goes on to the next line.
    quote: Option<u8>,
    /// Inside a block scalar: lines indented more than this (or blank)
    /// are its text. `None` in the column: a top-level scalar, to the end
    /// of the document.
    block_scalar: Option<Option<usize>>,
}

fn indent(line: &[u8]) -> usize {
    line.iter().take_while(|b| **b == b' ').count()
}

fn blank(line: &[u8]) -> bool {
    line.iter().all(|b| b.is_ascii_whitespace())
}

/// `---` or `...` alone or before a space: a document's start or end.
fn document_marker(line: &[u8]) -> bool {
    (line.starts_with(b"---") || line.starts_with(b"..."))
        && line.get(3).is_none_or(|b| b.is_ascii_whitespace())
}

/// A space, a tab or the end of the line at `i`.
fn space_at(line: &[u8], i: usize) -> bool {
    line.get(i).is_none_or(|b| *b == b' ' || *b == b'\t')
}

impl Scan {
    fn line(&mut self, line: &[u8]) -> Result<(), Deeper> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(parent) = self.block_scalar {
            let inside = blank(line) || parent.is_none_or(|p| indent(line) > p);
            if inside && !document_marker(line) {
                return Ok(());
            }
            self.block_scalar = None;
        }
        let mut at = 0;
        if let Some(q) = self.quote {
            match close_quote(line, 0, q) {
                Some(end) => {
                    self.quote = None;
                    at = end;
                }
                None => return Ok(()),
            }
            if self.flow == 0 {
                return Ok(()); // the rest of a multi-line value: a comment at most
            }
        }
        if self.flow > 0 {
            return self.flow_from(line, at);
        }
        if document_marker(line) {
            self.blocks.clear();
            return self.block_from(line, 3);
        }
        if line.first() == Some(&b'%') {
            return Ok(()); // a directive
        }
        self.block_from(line, indent(line))
    }

    /// Block context from `at`: a run of node starts (`- `, `key: `, `? `)
    /// and then one node.
    fn block_from(&mut self, line: &[u8], mut at: usize) -> Result<(), Deeper> {
        loop {
            while line.get(at).is_some_and(|b| *b == b' ' || *b == b'\t') {
                at += 1;
            }
            let Some(&c) = line.get(at) else {
                return Ok(());
            };
            match c {
                b'#' => return Ok(()),
                b'-' | b'?' if space_at(line, at + 1) => {
                    let kind = if c == b'-' { Kind::Seq } else { Kind::Map };
                    self.open_block(at, kind)?;
                    at += 1;
                }
                b'[' | b'{' => return self.flow_from(line, at),
                b'|' | b'>' => {
                    self.block_scalar = Some(self.blocks.last().map(|b| b.0));
                    return Ok(());
                }
                b'&' | b'!' => {
                    // An anchor or a tag, then the node it marks.
                    while line.get(at).is_some_and(|b| *b != b' ' && *b != b'\t') {
                        at += 1;
                    }
                }
                b'"' | b'\'' => match close_quote(line, at + 1, c) {
                    None => {
                        self.quote = Some(c);
                        return Ok(());
                    }
                    Some(end) => match key_colon(line, end) {
                        Some(next) => {
                            self.open_block(at, Kind::Map)?;
                            at = next;
                        }
                        None => return Ok(()),
                    },
                },
                _ => match plain_key_colon(line, at) {
                    Some(next) => {
                        self.open_block(at, Kind::Map)?;
                        at = next;
                    }
                    None => return Ok(()),
                },
            }
        }
    }

    /// A block collection of `kind` whose entry starts at `column`.
    fn open_block(&mut self, column: usize, kind: Kind) -> Result<(), Deeper> {
        while self.blocks.last().is_some_and(|b| b.0 > column) {
            self.blocks.pop();
        }
        match self.blocks.last().copied() {
            Some((c, k)) if c == column && k == kind => {}
            // A sequence at its parent key's column ends at that
            // mapping's next key.
            Some((c, Kind::Seq)) if c == column => {
                self.blocks.pop();
                if self.blocks.last() != Some(&(column, Kind::Map)) {
                    self.blocks.push((column, Kind::Map));
                }
            }
            _ => self.blocks.push((column, kind)),
        }
        self.depth_ok()
    }

    /// Flow context from `at` (at `[`, `{` or inside a collection).
    fn flow_from(&mut self, line: &[u8], mut at: usize) -> Result<(), Deeper> {
        // Quotes open a scalar only where a token starts.
        let mut token_start = true;
        while let Some(&c) = line.get(at) {
            match c {
                b'#' if token_start || at == 0 || line[at - 1] == b' ' => return Ok(()),
                b'"' | b'\'' if token_start => match close_quote(line, at + 1, c) {
                    Some(end) => {
                        at = end;
                        token_start = false;
                        continue;
                    }
                    None => {
                        self.quote = Some(c);
                        return Ok(());
                    }
                },
                b'[' | b'{' => {
                    self.flow += 1;
                    self.depth_ok()?;
                }
                b']' | b'}' => {
                    self.flow = self.flow.saturating_sub(1);
                    if self.flow == 0 {
                        return Ok(()); // what follows is a comment at most
                    }
                }
                _ => {}
            }
            token_start = matches!(c, b'[' | b'{' | b',' | b':' | b' ' | b'\t');
            at += 1;
        }
        Ok(())
    }

    fn depth_ok(&self) -> Result<(), Deeper> {
        if self.blocks.len() + self.flow > MAX_DEPTH {
            Err(Deeper)
        } else {
            Ok(())
        }
    }
}

/// Just past the quote that closes a scalar opened by `quote`, searching
/// from `at`: `\` escapes in double quotes, `''` is a quote in single ones.
fn close_quote(line: &[u8], mut at: usize, quote: u8) -> Option<usize> {
    while let Some(&c) = line.get(at) {
        if quote == b'"' && c == b'\\' {
            at += 2;
            continue;
        }
        if c == quote {
            if quote == b'\'' && line.get(at + 1) == Some(&b'\'') {
                at += 2;
                continue;
            }
            return Some(at + 1);
        }
        at += 1;
    }
    None
}

/// After a quoted scalar ending at `at`: past its `:` if it is a key.
fn key_colon(line: &[u8], mut at: usize) -> Option<usize> {
    while line.get(at) == Some(&b' ') {
        at += 1;
    }
    (line.get(at) == Some(&b':') && space_at(line, at + 1)).then_some(at + 1)
}

/// A plain scalar from `at`: past its `:` if it is a key (`: ` before any
/// ` #`).
fn plain_key_colon(line: &[u8], at: usize) -> Option<usize> {
    let mut i = at;
    while let Some(&c) = line.get(i) {
        if c == b'#' && i > at && line[i - 1] == b' ' {
            return None;
        }
        if c == b':' && space_at(line, i + 1) {
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_of(nest: impl Fn(usize) -> String) -> usize {
        (1..=MAX_DEPTH + 2)
            .find(|n| check(&nest(*n)).is_err())
            .map_or(usize::MAX, |n| n - 1)
    }

    #[test]
    fn flow_block_and_json_nesting_are_counted_to_the_limit() {
        let flow = |n: usize| format!("a: {}1{}", "[".repeat(n - 1), "]".repeat(n - 1));
        assert_eq!(depth_of(flow), MAX_DEPTH);
        let json = |n: usize| {
            let open = |i: usize| if i.is_multiple_of(2) { "[" } else { "{\"a\": " };
            let close = |i: usize| if i.is_multiple_of(2) { "]" } else { "}" };
            let opens: String = (0..n).map(open).collect();
            let closes: String = (0..n).rev().map(close).collect();
            format!("{opens}1{closes}")
        };
        assert_eq!(depth_of(json), MAX_DEPTH);
        let dashes = |n: usize| format!("{}x\n", "- ".repeat(n));
        assert_eq!(depth_of(dashes), MAX_DEPTH);
        let keys = |n: usize| (0..n).map(|i| format!("{}k:\n", " ".repeat(i))).collect();
        assert_eq!(depth_of(keys), MAX_DEPTH);
        // A sequence at its key's column is a level of its own: 2m - 1 levels.
        let at_key = |m: usize| {
            let below: String = (1..m)
                .map(|i| format!("{}- k:\n", " ".repeat(2 * (i - 1))))
                .collect();
            format!("k:\n{below}")
        };
        assert_eq!(check(&at_key(MAX_DEPTH / 2)), Ok(()));
        assert!(check(&at_key(MAX_DEPTH / 2 + 1)).is_err());
        assert_eq!(
            check(&"[".repeat(100_000)),
            Err(TooDeep { line: 1 }),
            "refused at the first level too many"
        );
    }

    #[test]
    fn brackets_in_text_count_nothing() {
        let many = "[{".repeat(MAX_DEPTH);
        let texts = [
            format!("a: \"{many}\"\nb: '{many}''s'\n"),
            format!("a: |\n  {many}\n  - - - -\nb: 1 # {many}\n"),
            format!("- >-\n    {many}\n- x{many}\n"),
            format!("a: \"multi\n  {many}\n  line\"\nb: [\"{many}\", 'x''{many}']\n"),
            format!("msg: don't [stop]\nnext: {{a: don't, b: \"{many}\"}}\n"),
        ];
        for text in texts {
            assert_eq!(check(&text), Ok(()), "{text}");
        }
    }

    #[test]
    fn documents_and_outdents_close_levels() {
        let deep = |n: usize| {
            (0..n)
                .map(|i| format!("{}k:\n", " ".repeat(i)))
                .collect::<String>()
        };
        let half = deep(MAX_DEPTH / 2 + 1);
        assert_eq!(check(&format!("{half}---\n{half}")), Ok(()));
        assert_eq!(check(&format!("{half}x: 1\n{half}")), Ok(()));
        let e = check(&deep(MAX_DEPTH + 1)).unwrap_err();
        assert_eq!(e.line, MAX_DEPTH + 1);
        assert!(e.to_string().contains("more than 128 levels"), "{e}");
    }
}
