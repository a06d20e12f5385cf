//! The training curve as a self-contained SVG, drawn with plotters: test
//! accuracy (left axis) and test and training loss (right axis) against
//! seconds of training.

use distbelief_proto::v1::CurvePoint;
use plotters::prelude::*;

const SIZE: (u32, u32) = (800, 420);

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
                "test_auc": c.test_auc,
                "test_loss": c.test_loss,
                "train_loss": c.train_loss,
                "sampled": c.sampled,
                "scored": c.scored,
            })
        })
        .collect();
    serde_json::Value::Array(points).to_string()
}

/// The curve as SVG; an error names what plotters could not draw.
pub fn curve_svg(title: &str, curve: &[CurvePoint]) -> Result<String, String> {
    let mut svg = String::new();
    draw(&mut svg, title, curve).map_err(|e| format!("cannot draw the curve: {e}"))?;
    Ok(svg)
}

fn draw<'a>(
    svg: &'a mut String,
    title: &str,
    curve: &[CurvePoint],
) -> Result<(), Box<dyn std::error::Error + 'a>> {
    let finite = |v: &f64| v.is_finite();
    let t_max = curve.iter().map(|c| c.seconds).fold(1e-9, f64::max);
    let losses = curve.iter().flat_map(|c| [c.test_loss, c.train_loss]);
    let loss_max = losses.filter(finite).fold(1e-9, f64::max);
    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{title}: test accuracy and loss"),
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .right_y_label_area_size(50)
        .build_cartesian_2d(0.0..t_max, 0.0..1.0)?
        .set_secondary_coord(0.0..t_max, 0.0..loss_max);
    chart
        .configure_mesh()
        .x_desc("seconds of training")
        .y_desc("test accuracy")
        .draw()?;
    chart.configure_secondary_axes().y_desc("loss").draw()?;
    let accuracy = curve
        .iter()
        .map(|c| (c.seconds, c.test_accuracy.clamp(0.0, 1.0)));
    let blue = RGBColor(0x1f, 0x77, 0xb4);
    chart
        .draw_series(LineSeries::new(accuracy, blue.stroke_width(2)))?
        .label("test accuracy")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], blue.stroke_width(2)));
    let losses = [
        (
            "test loss",
            RGBColor(0xd6, 0x27, 0x28),
            curve.iter().map(|c| c.test_loss).collect::<Vec<_>>(),
        ),
        (
            "training loss",
            RGBColor(0x7f, 0x7f, 0x7f),
            curve.iter().map(|c| c.train_loss).collect(),
        ),
    ];
    for (label, colour, values) in losses {
        let points: Vec<(f64, f64)> = curve
            .iter()
            .zip(values)
            .filter(|(_, v)| v.is_finite())
            .map(|(c, v)| (c.seconds, v))
            .collect();
        if points.is_empty() {
            continue;
        }
        chart
            .draw_secondary_series(LineSeries::new(points, colour))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE)
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_every_point_and_skips_unknown_losses() {
        let curve: Vec<CurvePoint> = (0..4)
            .map(|i| CurvePoint {
                test_auc: None,
                seconds: f64::from(i),
                test_accuracy: 0.2 * f64::from(i),
                test_loss: 2.0 - 0.4 * f64::from(i),
                train_loss: f64::NAN,
                examples: 0,
                sampled: i == 1,
                scored: 100,
            })
            .collect();
        let svg = curve_svg("a<b", &curve).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("a&lt;b"), "the title is escaped");
        assert!(svg.contains("test accuracy") && svg.contains("test loss"));
        assert!(
            !svg.contains("training loss"),
            "no training-loss line when it is unknown"
        );
        let lines: Vec<&str> = svg.lines().filter(|l| l.contains("<polyline")).collect();
        assert!(
            lines.iter().any(|l| l.matches(',').count() == 4),
            "a line through the 4 evaluations"
        );
        assert!(curve_svg("empty", &[]).is_ok());
    }
}
