//! One SVG, drawn with plotters: test accuracy against seconds (left) and
//! against examples (right), one line per configuration, legend below.

use plotters::prelude::*;

/// (seconds, examples, test accuracy) at one evaluation.
pub type Point = (f64, u64, f64);

/// A configuration's curve.
pub struct Series<'a> {
    pub label: &'a str,
    pub points: &'a [Point],
}

const PANEL: (u32, u32) = (540, 380);
const LEGEND_ROW: u32 = 18;
/// Accuracy axis: below this the curves are all the same early climb.
const ACCURACY: std::ops::Range<f64> = 0.6..0.9;

fn colour(k: usize) -> RGBColor {
    const COLOURS: [(u8, u8, u8); 12] = [
        (0, 0, 0),
        (0x1f, 0x77, 0xb4),
        (0xff, 0x7f, 0x0e),
        (0x2c, 0xa0, 0x2c),
        (0xd6, 0x27, 0x28),
        (0x94, 0x67, 0xbd),
        (0x8c, 0x56, 0x4b),
        (0xe3, 0x77, 0xc2),
        (0x7f, 0x7f, 0x7f),
        (0xbc, 0xbd, 0x22),
        (0x17, 0xbe, 0xcf),
        (0xae, 0xc7, 0xe8),
    ];
    let (r, g, b) = COLOURS[k % COLOURS.len()];
    RGBColor(r, g, b)
}

/// The plot as SVG text; an error names what plotters could not draw.
pub fn svg(title: &str, series: &[Series], target: Option<f64>) -> Result<String, String> {
    let mut out = String::new();
    draw(&mut out, title, series, target).map_err(|e| format!("cannot draw the plot: {e}"))?;
    Ok(out)
}

type Drawn<'a> = Result<(), Box<dyn std::error::Error + 'a>>;

fn draw<'a>(out: &'a mut String, title: &str, series: &[Series], target: Option<f64>) -> Drawn<'a> {
    let legend_h = LEGEND_ROW * series.len().div_ceil(2) as u32 + 20;
    let size = (2 * PANEL.0, PANEL.1 + 40 + legend_h);
    let root = SVGBackend::with_string(out, size).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let (panels, legend) = root.split_vertically(PANEL.1);
    let halves = panels.split_evenly((1, 2));
    let x_of: [fn(&Point) -> f64; 2] = [|p| p.0, |p| p.1 as f64];
    for (panel, (area, name)) in halves
        .iter()
        .zip(["seconds of training", "examples trained on"])
        .enumerate()
    {
        let x_max = series
            .iter()
            .flat_map(|s| s.points.iter().map(x_of[panel]))
            .fold(1e-9, f64::max);
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d(0.0..x_max, ACCURACY)?;
        let thousands = |x: &f64| format!("{:.0}k", x / 1000.0);
        let whole = |x: &f64| format!("{x:.0}");
        let label: &dyn Fn(&f64) -> String = if panel == 0 { &whole } else { &thousands };
        chart
            .configure_mesh()
            .x_desc(name)
            .y_desc("test accuracy")
            .x_label_formatter(label)
            .draw()?;
        if let Some(t) = target {
            let dashed = DashedLineSeries::new([(0.0, t), (x_max, t)], 4, 4, BLACK.mix(0.4).into());
            chart.draw_series(dashed)?;
        }
        for (k, s) in series.iter().enumerate() {
            let points = s.points.iter().map(|p| {
                let a = p.2.clamp(ACCURACY.start, ACCURACY.end);
                (x_of[panel](p), a)
            });
            chart.draw_series(LineSeries::new(points, colour(k).stroke_width(2)))?;
        }
    }
    for (k, s) in series.iter().enumerate() {
        let x = 60 + (k % 2) as i32 * PANEL.0 as i32;
        let y = 10 + LEGEND_ROW as i32 * (k / 2) as i32;
        let line = PathElement::new([(x, y), (x + 24, y)], colour(k).stroke_width(3));
        legend.draw(&line)?;
        legend.draw(&Text::new(s.label, (x + 30, y - 6), ("sans-serif", 12)))?;
    }
    root.present()?;
    Ok(())
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
        let svg = super::svg("t", &series, Some(0.85)).unwrap();
        // Two series in two panels, two legend swatches, the target line in
        // each panel as dashes.
        assert!(svg.matches("<polyline").count() >= 6);
        assert!(svg.contains("one &amp; only"));
        assert!(svg.contains("examples trained on") && svg.contains("seconds of training"));
    }
}
