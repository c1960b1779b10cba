//! One SVG line plot per scenario, with plotters.

use std::path::Path;

use plotters::prelude::*;

/// Draws `series` (name, points (x, y)) as lines with markers; x on a log scale when it spans
/// more than a factor of 10.
pub fn lines(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) {
    let pts = series.iter().flat_map(|(_, p)| p.iter().copied());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, 0f64, 0f64);
    for (x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if !x0.is_finite() {
        return;
    }
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).expect("plot background");
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((x0 * 0.8..x1 * 1.25).log_scale(), 0f64..y1 * 1.1)
        .expect("plot axes");
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .expect("plot mesh");
    for (i, (name, p)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(p.iter().copied(), color.stroke_width(2)))
            .expect("plot line")
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                p.iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
            )
            .expect("plot points");
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .expect("plot legend");
    root.present().expect("write plot");
}
