//! The chart of a session's calls over time: inline SVG drawn on the
//! server (no script), one lane per call, one bar per state it was in.

use super::html::{duration, escape};
use std::fmt::Write as _;

/// The most lanes a chart draws; the rest are counted under it.
pub const MAX_LANES: usize = 100;
const WIDTH: i64 = 900;
const LABELS: i64 = 150;
const ROW: i64 = 22;
const TOP: i64 = 24;

/// What a call was doing during a span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shade {
    /// Ready or running: from the model's reply to its deferral or result.
    Running,
    /// Waiting on its continuation (a decision, a person, a Job, a task).
    Deferred,
    Completed,
    Failed,
}

impl Shade {
    fn colour(self) -> &'static str {
        match self {
            Shade::Running => "#4a90d9",
            Shade::Deferred => "#f5a623",
            Shade::Completed => "#5cb85c",
            Shade::Failed => "#d9534f",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Shade::Running => "Running",
            Shade::Deferred => "Deferred",
            Shade::Completed => "Completed",
            Shade::Failed => "Failed",
        }
    }
}

/// A state held from `from` to `to` (milliseconds since the epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub shade: Shade,
    pub from: i64,
    pub to: i64,
}

/// One call's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lane {
    pub label: String,
    pub spans: Vec<Span>,
}

/// The chart, or a sentence when no call has a recorded time.
pub fn chart(lanes: &[Lane]) -> String {
    let timed: Vec<&Lane> = lanes.iter().filter(|l| !l.spans.is_empty()).collect();
    let Some((t0, t1)) = bounds(&timed) else {
        return "<p class=muted id=chart>No call has a recorded time yet.</p>".into();
    };
    let shown = &timed[..timed.len().min(MAX_LANES)];
    let height = TOP + ROW * shown.len() as i64 + 30;
    let mut svg = format!(
        "<svg id=chart xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" role=img aria-label=\"calls over time\" font-family=sans-serif font-size=12>"
    );
    let _ = write!(
        svg,
        "<text x=\"{LABELS}\" y=\"14\">0s</text><text x=\"{WIDTH}\" y=\"14\" text-anchor=end>{}</text>",
        duration(t1 - t0)
    );
    for (row, lane) in shown.iter().enumerate() {
        svg.push_str(&lane_svg(lane, row as i64, t0, t1));
    }
    svg.push_str(&legend(height - 8));
    svg.push_str("</svg>");
    if timed.len() > shown.len() {
        let _ = write!(
            svg,
            "<p class=muted>{} more calls are not drawn.</p>",
            timed.len() - shown.len()
        );
    }
    svg
}

/// The first start and last end over all spans; never an empty range.
fn bounds(lanes: &[&Lane]) -> Option<(i64, i64)> {
    let spans = lanes.iter().flat_map(|l| l.spans.iter());
    let t0 = spans.clone().map(|s| s.from).min()?;
    let t1 = spans.map(|s| s.to).max()?.max(t0 + 1);
    Some((t0, t1))
}

fn x_of(t: i64, t0: i64, t1: i64) -> i64 {
    LABELS + (t - t0) * (WIDTH - LABELS) / (t1 - t0)
}

fn lane_svg(lane: &Lane, row: i64, t0: i64, t1: i64) -> String {
    let y = TOP + row * ROW;
    let mut s = format!(
        "<text x=\"0\" y=\"{}\">{}</text>",
        y + 14,
        escape(&super::html::clip(&lane.label, 24))
    );
    for span in &lane.spans {
        // An instant (a result) is a thin mark, kept inside the chart.
        let w = (x_of(span.to, t0, t1) - x_of(span.from, t0, t1)).max(4);
        let x = x_of(span.from, t0, t1).min(WIDTH - w);
        let _ = write!(
            s,
            "<rect class=\"{}\" x=\"{x}\" y=\"{}\" width=\"{w}\" height=\"{}\" fill=\"{}\"><title>{}: {} {}</title></rect>",
            span.shade.name(),
            y + 3,
            ROW - 6,
            span.shade.colour(),
            escape(&lane.label),
            span.shade.name(),
            duration(span.to - span.from),
        );
    }
    s
}

fn legend(y: i64) -> String {
    let mut s = String::new();
    for (i, shade) in [
        Shade::Running,
        Shade::Deferred,
        Shade::Completed,
        Shade::Failed,
    ]
    .into_iter()
    .enumerate()
    {
        let x = LABELS + i as i64 * 110;
        let _ = write!(
            s,
            "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{y}\">{}</text>",
            y - 10,
            shade.colour(),
            x + 16,
            shade.name()
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(label: &str, spans: &[(Shade, i64, i64)]) -> Lane {
        Lane {
            label: label.into(),
            spans: spans
                .iter()
                .map(|&(shade, from, to)| Span { shade, from, to })
                .collect(),
        }
    }

    #[test]
    fn spans_are_placed_on_one_time_axis() {
        let svg = chart(&[
            lane(
                "t1-c0 search",
                &[(Shade::Running, 0, 1000), (Shade::Completed, 1000, 1000)],
            ),
            lane(
                "t1-c1 publish",
                &[
                    (Shade::Deferred, 1000, 10_000),
                    (Shade::Completed, 10_000, 10_000),
                ],
            ),
        ]);
        assert!(svg.starts_with("<svg id=chart"), "{svg}");
        // 750 pixels for 10 s: the first run ends 75 pixels in.
        assert!(
            svg.contains("<rect class=\"Running\" x=\"150\" y=\"27\" width=\"75\""),
            "{svg}"
        );
        assert!(
            svg.contains("<rect class=\"Deferred\" x=\"225\" y=\"49\" width=\"675\""),
            "{svg}"
        );
        // An instant still shows.
        assert!(
            svg.contains("class=\"Completed\" x=\"896\" y=\"49\" width=\"4\""),
            "{svg}"
        );
        assert!(svg.contains(">10.0s</text>"), "{svg}");
        assert!(!svg.contains("<script"), "{svg}");
    }

    #[test]
    fn labels_are_escaped() {
        let svg = chart(&[lane("<script>x</script>", &[(Shade::Failed, 5, 9)])]);
        assert!(svg.contains("&lt;script&gt;x&lt;/script&gt;"), "{svg}");
        assert!(!svg.contains("<script>"), "{svg}");
    }

    #[test]
    fn no_times_make_a_sentence_not_a_chart() {
        assert!(chart(&[]).contains("No call has a recorded time"));
        assert!(chart(&[lane("t1-c0", &[])]).contains("No call has a recorded time"));
    }

    #[test]
    fn lanes_are_bounded() {
        let lanes: Vec<Lane> = (0..150)
            .map(|i| lane(&format!("c{i}"), &[(Shade::Running, i, i + 1)]))
            .collect();
        let svg = chart(&lanes);
        assert_eq!(svg.matches("<rect class=").count(), MAX_LANES);
        assert!(svg.contains("50 more calls are not drawn"), "{svg}");
    }
}
