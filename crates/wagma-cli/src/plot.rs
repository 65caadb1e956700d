//! Plots for reports, each written as PNG and SVG: lines (a metric over time or samples) and
//! grouped bars (throughputs, histograms). Text uses a TrueType font of the system (DejaVu
//! Sans or Liberation Sans); without one no plot is drawn and the report says so.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{Context, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One line of a line plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points `(x, y)`.
    pub points: Vec<(f64, f64)>,
}

const FONT_CANDIDATES: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// Registers a system font once; false when none is available.
pub fn font_available() -> bool {
    static FOUND: OnceLock<bool> = OnceLock::new();
    *FOUND.get_or_init(|| {
        for path in FONT_CANDIDATES {
            if let Ok(bytes) = std::fs::read(path) {
                // The registry wants 'static bytes; one font for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

const SIZE: (u32, u32) = (900, 560);

fn palette(i: usize) -> RGBColor {
    const C: [RGBColor; 10] = [
        RGBColor(214, 39, 40),
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(255, 127, 14),
        RGBColor(148, 103, 189),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(127, 127, 127),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
    ];
    C[i % C.len()]
}

/// Draws with both backends: `stem.png` and `stem.svg`.
fn both(
    stem: &Path,
    draw: impl Fn(DrawingArea<BitMapBackend<'_>, Shift>) -> anyhow::Result<()>,
    draw_svg: impl Fn(DrawingArea<SVGBackend<'_>, Shift>) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<PathBuf>> {
    if !font_available() {
        return Err(anyhow!(
            "no TrueType font found (install fonts-dejavu-core); plots skipped"
        ));
    }
    let png = stem.with_extension("png");
    let svg = stem.with_extension("svg");
    {
        let root = BitMapBackend::new(&png, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        draw(root.clone())?;
        root.present()
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| png.display().to_string())?;
    }
    {
        let root = SVGBackend::new(&svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
        draw_svg(root.clone())?;
        root.present()
            .map_err(|e| anyhow!("{e}"))
            .with_context(|| svg.display().to_string())?;
    }
    Ok(vec![png, svg])
}

fn span(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if (hi - lo).abs() < 1e-12 {
        return (lo - 0.5, hi + 0.5);
    }
    let pad = (hi - lo) * 0.05;
    (lo - pad, hi + pad)
}

fn draw_lines<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    xl: &str,
    yl: &str,
    series: &[Series],
    hline: Option<(f64, &str)>,
) -> anyhow::Result<()> {
    let (x0, x1) = span(series.iter().flat_map(|s| s.points.iter().map(|p| p.0)));
    let (y0, y1) = span(
        series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .chain(hline.map(|h| h.0)),
    );
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(xl)
        .y_desc(yl)
        .draw()
        .map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let c = palette(i);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    if let Some((y, name)) = hline {
        chart
            .draw_series(LineSeries::new(
                vec![(x0, y), (x1, y)],
                BLACK.stroke_width(1),
            ))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], BLACK.stroke_width(1))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// A line plot of `series`, optionally with a horizontal reference line.
pub fn lines(
    stem: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
    hline: Option<(f64, &str)>,
) -> anyhow::Result<Vec<PathBuf>> {
    both(
        stem,
        |r| draw_lines(r, title, x_label, y_label, series, hline),
        |r| draw_lines(r, title, x_label, y_label, series, hline),
    )
}

fn draw_bars<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    yl: &str,
    categories: &[String],
    groups: &[(String, Vec<f64>)],
) -> anyhow::Result<()> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("{e}");
    let ymax = groups
        .iter()
        .flat_map(|g| g.1.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let n = categories.len().max(1);
    let k = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc(yl)
        .draw()
        .map_err(err)?;
    // Category names under their bars.
    let style =
        TextStyle::from(("sans-serif", 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (i, c) in categories.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        root.draw(&Text::new(c.clone(), (x, y + 8), style.clone()))
            .map_err(err)?;
    }
    for (gi, (name, values)) in groups.iter().enumerate() {
        let c = palette(gi);
        let w = 0.8 / k;
        chart
            .draw_series(values.iter().enumerate().map(|(i, &v)| {
                let x0 = i as f64 + 0.1 + gi as f64 * w;
                Rectangle::new([(x0, 0.0), (x0 + w * 0.95, v)], c.filled())
            }))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Grouped bars: for each category, one bar per group.
pub fn bars(
    stem: &Path,
    title: &str,
    y_label: &str,
    categories: &[String],
    groups: &[(String, Vec<f64>)],
) -> anyhow::Result<Vec<PathBuf>> {
    both(
        stem,
        |r| draw_bars(r, title, y_label, categories, groups),
        |r| draw_bars(r, title, y_label, categories, groups),
    )
}
