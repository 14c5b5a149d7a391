//! The scaling points as an SVG for the performance page: a panel per dimension, size on
//! a log scale, the medians of connect4 and of all programs in ns per connection.
use anyhow::Context;
use plotters::prelude::*;

use super::{
    figures::median,
    report::{Dimension, Report, ScalePoint},
};

/// The plot, beside docs/performance.md, which links it.
pub const FILE: &str = "scaling.svg";

const SIZE: (u32, u32) = (960, 360);

/// A plotted line: its name, its colour, and a point's value on it.
type Line = (&'static str, RGBColor, fn(&ScalePoint) -> f64);

const LINES: [Line; 2] = [
    ("connect4", BLUE, |p| median(&p.connect4_ns)),
    ("all programs", RED, |p| median(&p.all_ns)),
];

impl Report {
    /// The plot of the scaling points as SVG text; None in a run without them.
    pub fn scaling_svg(&self) -> anyhow::Result<Option<String>> {
        if self.scaling.is_empty() {
            return Ok(None);
        }
        let top = self
            .scaling
            .iter()
            .map(|p| median(&p.all_ns))
            .fold(0.0, f64::max);
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
            root.fill(&WHITE).context("plot background")?;
            let panels = root.split_evenly((1, Dimension::ALL.len()));
            for (area, dimension) in panels.iter().zip(Dimension::ALL) {
                let points: Vec<_> = self
                    .scaling
                    .iter()
                    .filter(|p| p.dimension == dimension)
                    .collect();
                let sizes = points.iter().map(|p| p.size as f64);
                let (lo, hi) = sizes.fold((f64::INFINITY, 0.0_f64), |(lo, hi), s| {
                    (lo.min(s), hi.max(s))
                });
                let mut chart = ChartBuilder::on(area)
                    .caption(dimension.name(), ("sans-serif", 18))
                    .margin(12)
                    .x_label_area_size(36)
                    .y_label_area_size(52)
                    .build_cartesian_2d(
                        (lo / 2.0..hi * 2.0).log_scale(),
                        0.0..(top * 1.15).max(1.0),
                    )
                    .context("plot axes")?;
                chart
                    .configure_mesh()
                    .x_desc("size")
                    .y_desc("ns per connection")
                    .x_label_formatter(&|v| super::render::num(*v, 0))
                    .y_label_formatter(&|v| super::render::num(*v, 0))
                    .draw()
                    .context("plot mesh")?;
                for (name, color, ns) in LINES {
                    let line: Vec<(f64, f64)> =
                        points.iter().map(|p| (p.size as f64, ns(p))).collect();
                    chart
                        .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
                        .context("plot line")?
                        .label(name)
                        .legend(move |(x, y)| {
                            PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2))
                        });
                    chart
                        .draw_series(
                            line.into_iter()
                                .map(|xy| Circle::new(xy, 3, color.filled())),
                        )
                        .context("plot points")?;
                }
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::MiddleRight)
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .context("plot legend")?;
            }
            root.present().context("plot")?;
        }
        Ok(Some(svg))
    }
}

#[cfg(test)]
mod tests {
    use crate::bench::report::{Dimension, sample};

    #[test]
    fn the_plot_has_a_panel_per_dimension_and_both_lines() {
        let svg = sample::report(300.0).scaling_svg().unwrap().unwrap();
        for d in Dimension::ALL {
            assert!(svg.contains(d.name()), "no panel for {}", d.name());
        }
        assert_eq!(svg.matches("connect4").count(), 3, "{svg}");
        assert_eq!(svg.matches("all programs").count(), 3);
        assert!(svg.contains("100,000"), "sizes with separators");
    }

    #[test]
    fn no_scaling_no_plot() {
        let mut report = sample::report(300.0);
        report.scaling.clear();
        assert!(report.scaling_svg().unwrap().is_none());
        assert!(!report.markdown().contains("as connguard holds more"));
    }
}
