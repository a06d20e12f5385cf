//! One SVG: test accuracy against seconds (left) and against examples
//! (right), one line per configuration.

use std::fmt::Write;

/// A configuration's curve: (seconds, examples, test accuracy) points.
pub struct Series<'a> {
    pub label: &'a str,
    pub points: &'a [(f64, u64, f64)],
}

const PANEL_W: f64 = 480.0;
const PANEL_H: f64 = 320.0;
const MARGIN: f64 = 60.0;
const LEGEND_ROW: f64 = 18.0;
const COLOURS: [&str; 12] = [
    "#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8",
];
/// Accuracy axis: below this the curves are all the same early climb.
const ACC_MIN: f64 = 0.6;
const ACC_MAX: f64 = 0.9;

pub fn svg(title: &str, series: &[Series], target: Option<f64>) -> String {
    let legend_h = LEGEND_ROW * series.len().div_ceil(2) as f64 + 10.0;
    let (w, h) = (
        2.0 * (PANEL_W + MARGIN) + MARGIN,
        PANEL_H + 2.0 * MARGIN + legend_h,
    );
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
        w / 2.0,
        escape(title)
    );
    let x_of = [|p: &(f64, u64, f64)| p.0, |p: &(f64, u64, f64)| p.1 as f64];
    for (panel, name) in ["seconds of training", "examples trained on"]
        .iter()
        .enumerate()
    {
        let x0 = MARGIN + panel as f64 * (PANEL_W + MARGIN);
        let x_max = series
            .iter()
            .flat_map(|s| s.points.iter().map(x_of[panel]))
            .fold(0.0, f64::max)
            .max(1e-9);
        let px = |x: f64| x0 + x / x_max * PANEL_W;
        let py =
            |a: f64| MARGIN + (ACC_MAX - a.clamp(ACC_MIN, ACC_MAX)) / (ACC_MAX - ACC_MIN) * PANEL_H;
        let _ = write!(
            s,
            r##"<rect x="{x0}" y="{MARGIN}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#444"/><text x="{}" y="{}" text-anchor="middle">{name}</text>"##,
            x0 + PANEL_W / 2.0,
            MARGIN + PANEL_H + 36.0
        );
        for i in 0..=5 {
            let (x, a) = (
                x_max * i as f64 / 5.0,
                ACC_MIN + (ACC_MAX - ACC_MIN) * i as f64 / 5.0,
            );
            let label = if panel == 0 {
                format!("{x:.0}")
            } else {
                format!("{:.0}k", x / 1000.0)
            };
            let _ = write!(
                s,
                r#"<text x="{}" y="{}" text-anchor="middle">{label}</text><text x="{}" y="{}" text-anchor="end">{a:.2}</text>"#,
                px(x),
                MARGIN + PANEL_H + 16.0,
                x0 - 6.0,
                py(a) + 4.0
            );
        }
        if let Some(t) = target {
            let _ = write!(
                s,
                r##"<line x1="{x0}" x2="{}" y1="{y}" y2="{y}" stroke="#999" stroke-dasharray="4 4"/>"##,
                x0 + PANEL_W,
                y = py(t)
            );
        }
        for (k, series) in series.iter().enumerate() {
            let pts: Vec<String> = series
                .points
                .iter()
                .map(|p| format!("{:.1},{:.1}", px(x_of[panel](p)), py(p.2)))
                .collect();
            let _ = write!(
                s,
                r#"<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>"#,
                COLOURS[k % COLOURS.len()],
                pts.join(" ")
            );
        }
    }
    for (k, series) in series.iter().enumerate() {
        let x = MARGIN + (k % 2) as f64 * (PANEL_W + MARGIN);
        let y = 2.0 * MARGIN + PANEL_H + LEGEND_ROW * (k / 2) as f64;
        let _ = write!(
            s,
            r#"<line x1="{x}" x2="{}" y1="{y}" y2="{y}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            x + 24.0,
            COLOURS[k % COLOURS.len()],
            x + 30.0,
            y + 4.0,
            escape(series.label)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_series_gets_a_line_in_both_panels_and_a_legend_entry() {
        let a = [(1.0, 100, 0.7), (2.0, 200, 0.86)];
        let b = [(1.5, 300, 0.8)];
        let series = [
            super::Series {
                label: "one & only",
                points: &a,
            },
            super::Series {
                label: "b",
                points: &b,
            },
        ];
        let svg = super::svg("t", &series, Some(0.85));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.contains("one &amp; only"));
        assert!(svg.contains("stroke-dasharray"), "the target line");
    }
}
