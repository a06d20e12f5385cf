//! The training curve as a self-contained SVG: test accuracy (left axis) and
//! test and training loss (right axis) against seconds of training.

use std::fmt::Write;

use distbelief_proto::v1::CurvePoint;

const W: f64 = 800.0;
const H: f64 = 420.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 60.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

/// The evaluations as JSON, one object per evaluation, for tools that plot
/// or compare runs.
pub fn curve_json(curve: &[CurvePoint]) -> String {
    let points: Vec<serde_json::Value> = curve
        .iter()
        .map(|c| {
            serde_json::json!({
                "seconds": c.seconds,
                "examples": c.examples,
                "test_accuracy": c.test_accuracy,
                "test_loss": c.test_loss,
                "train_loss": c.train_loss,
            })
        })
        .collect();
    serde_json::Value::Array(points).to_string()
}

pub fn curve_svg(title: &str, curve: &[CurvePoint]) -> String {
    let pw = W - LEFT - RIGHT;
    let ph = H - TOP - BOTTOM;
    let t_max = curve
        .iter()
        .map(|c| c.seconds)
        .fold(0.0, f64::max)
        .max(1e-9);
    let loss_max = curve
        .iter()
        .flat_map(|c| [c.test_loss, c.train_loss])
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        .max(1e-9);
    let x = |t: f64| LEFT + pw * t / t_max;
    let y_acc = |a: f64| TOP + ph * (1.0 - a.clamp(0.0, 1.0));
    let y_loss = |l: f64| TOP + ph * (1.0 - (l / loss_max).clamp(0.0, 1.0));
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" text-anchor="middle" font-size="15">{}: test accuracy and loss</text>
<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>
"##,
        W / 2.0,
        escape(title)
    );
    for i in 0..=5 {
        let f = f64::from(i) / 5.0;
        let yy = TOP + ph * (1.0 - f);
        let xx = LEFT + pw * f;
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy}" x2="{}" y2="{yy}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end" fill="#1f77b4">{f:.1}</text><text x="{}" y="{}" fill="#d62728">{:.2}</text><text x="{xx}" y="{}" text-anchor="middle">{:.0}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0,
            LEFT + pw + 6.0,
            yy + 4.0,
            loss_max * f,
            TOP + ph + 18.0,
            t_max * f
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" text-anchor="middle">seconds of training</text>
<text x="16" y="{}" fill="#1f77b4" transform="rotate(-90 16 {})" text-anchor="middle">test accuracy</text>
<text x="{}" y="{}" fill="#d62728" transform="rotate(90 {} {})" text-anchor="middle">loss</text>"##,
        LEFT + pw / 2.0,
        H - 12.0,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        W - 16.0,
        TOP + ph / 2.0,
        W - 16.0,
        TOP + ph / 2.0
    );
    type Series<'a> = (
        &'a str,
        &'a str,
        Box<dyn Fn(&CurvePoint) -> Option<f64> + 'a>,
    );
    let series: [Series; 3] = [
        ("#1f77b4", "", Box::new(|c| Some(y_acc(c.test_accuracy)))),
        ("#d62728", "", Box::new(|c| Some(y_loss(c.test_loss)))),
        (
            "#ff9896",
            r#" stroke-dasharray="5,3""#,
            Box::new(|c| c.train_loss.is_finite().then(|| y_loss(c.train_loss))),
        ),
    ];
    for (color, dash, f) in &series {
        let pts: Vec<String> = curve
            .iter()
            .filter_map(|c| f(c).map(|yy| format!("{:.1},{:.1}", x(c.seconds), yy)))
            .collect();
        if !pts.is_empty() {
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                pts.join(" ")
            );
        }
    }
    let _ = writeln!(
        s,
        r##"<g transform="translate({} {})"><line x1="0" y1="0" x2="20" y2="0" stroke="#1f77b4" stroke-width="2"/><text x="25" y="4">test accuracy</text><line x1="0" y1="16" x2="20" y2="16" stroke="#d62728" stroke-width="2"/><text x="25" y="20">test loss</text><line x1="0" y1="32" x2="20" y2="32" stroke="#ff9896" stroke-width="2" stroke-dasharray="5,3"/><text x="25" y="36">training loss</text></g>
</svg>"##,
        LEFT + pw - 130.0,
        TOP + ph - 50.0
    );
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_every_point() {
        let curve: Vec<CurvePoint> = (0..4)
            .map(|i| CurvePoint {
                seconds: f64::from(i),
                test_accuracy: 0.2 * f64::from(i),
                test_loss: 2.0 - 0.4 * f64::from(i),
                train_loss: f64::NAN,
                examples: 0,
            })
            .collect();
        let svg = curve_svg("a<b", &curve);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b"));
        assert_eq!(
            svg.matches("<polyline").count(),
            2,
            "no training-loss line when it is unknown"
        );
        let acc_line = svg
            .lines()
            .find(|l| l.contains("#1f77b4\" stroke-width=\"2\" points"))
            .unwrap();
        assert_eq!(acc_line.matches(',').count(), 4);
        // Accuracy 0 sits on the bottom edge, 0.6 higher up.
        assert!(acc_line.contains(&format!("{:.1},{:.1}", LEFT, H - BOTTOM)));
        assert!(!curve_svg("empty", &[]).contains("<polyline"));
    }
}
