//! `railyard bench --sweep --plot FILE.svg`: the sweep drawn with plotters — GB/s against
//! block size for each direction and batch size, with the ceiling as a line of its own, and
//! p99 latency per batch beside it.

use std::path::Path;

use plotters::coord::CoordTranslate;
use plotters::prelude::*;

use super::report::{Occasion, ShapeResult};
use crate::cli::size::format_size;

/// Most block-size labels on an axis (plotters picks round steps of log2: 4 KiB, 16 KiB…).
const X_LABELS: usize = 9;
/// Pixels of the whole picture.
const SIZE: (u32, u32) = (1400, 560);
const FONT: &str = "sans-serif";

/// One line of a panel: its name and its points, (log2 of the block size, value).
struct Line {
    name: String,
    points: Vec<(f64, f64)>,
}

/// Draws `rows` (a sweep, in its order) into an SVG at `path`.
pub(super) fn plot(
    path: &Path,
    fabric: &str,
    occasion: &Occasion,
    rows: &[ShapeResult],
) -> anyhow::Result<()> {
    let bandwidth = lines(rows, |row| row.gbps());
    let latency = lines(rows, |row| row.latency_us(0.99));
    let ceiling = ceiling_line(rows);
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!(
            "railyard bench --sweep: {fabric} fabric on {}, {}",
            occasion.host, occasion.date
        ),
        (FONT, 22),
    )?;
    let (left, right) = root.split_horizontally(SIZE.0 / 2);
    let blocks = block_range(rows);

    let top = bandwidth
        .iter()
        .chain(std::iter::once(&ceiling))
        .flat_map(|line| line.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let mut chart = ChartBuilder::on(&left)
        .caption("Bandwidth by block size", (FONT, 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(blocks.clone(), 0.0..(top * 1.1).max(0.001))?;
    chart
        .configure_mesh()
        .x_desc("block size (bytes, log scale)")
        .y_desc("bandwidth (GB/s)")
        .x_labels(X_LABELS)
        .x_label_formatter(&block_label)
        .draw()?;
    draw_lines(&mut chart, &bandwidth)?;
    chart
        .draw_series(LineSeries::new(
            ceiling.points.clone(),
            BLACK.stroke_width(3),
        ))?
        .label(ceiling.name.clone())
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.stroke_width(3)));
    draw_legend(&mut chart)?;

    let (low, high) = latency
        .iter()
        .flat_map(|line| line.points.iter().map(|p| p.1))
        .filter(|us| *us > 0.0)
        .fold((f64::MAX, 0.0f64), |(low, high), us| {
            (low.min(us), high.max(us))
        });
    let (low, high) = if high > 0.0 {
        (low / 2.0, high * 2.0)
    } else {
        (1.0, 10.0)
    };
    let mut chart = ChartBuilder::on(&right)
        .caption("p99 latency per batch by block size", (FONT, 18))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(blocks, (low..high).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("block size (bytes, log scale)")
        .y_desc("p99 latency per batch (µs, log scale)")
        .y_label_formatter(&|us| format!("{us:.0}"))
        .x_labels(X_LABELS)
        .x_label_formatter(&block_label)
        .draw()?;
    draw_lines(&mut chart, &latency)?;
    draw_legend(&mut chart)?;
    root.present()?;
    Ok(())
}

/// Draws each of `lines` in a colour of its own, with its points marked and its name in the
/// legend.
fn draw_lines<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
    lines: &[Line],
) -> anyhow::Result<()>
where
    X: plotters::coord::ranged1d::Ranged<ValueType = f64>,
    Y: plotters::coord::ranged1d::Ranged<ValueType = f64>,
    Cartesian2d<X, Y>: CoordTranslate<From = (f64, f64)>,
{
    for (index, line) in lines.iter().enumerate() {
        let colour = Palette99::pick(index).to_rgba();
        chart
            .draw_series(LineSeries::new(line.points.clone(), colour.stroke_width(2)))?
            .label(line.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], colour));
        chart.draw_series(
            line.points
                .iter()
                .map(|&point| Circle::new(point, 3, colour.filled())),
        )?;
    }
    Ok(())
}

/// The chart's legend, in its upper left corner.
fn draw_legend<'a, X, Y>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
) -> anyhow::Result<()>
where
    X: plotters::coord::ranged1d::Ranged<ValueType = f64>,
    Y: plotters::coord::ranged1d::Ranged<ValueType = f64>,
    Cartesian2d<X, Y>: CoordTranslate<From = (f64, f64)>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

/// One line per direction and batch size, in the rows' order: `value` of each row against
/// its block size.
fn lines(rows: &[ShapeResult], value: impl Fn(&ShapeResult) -> f64) -> Vec<Line> {
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for row in rows {
        let name = format!("{}, batch {}", row.shape.op_name(), row.shape.batch);
        let point = (log2(row.shape.block), value(row));
        match lines.iter_mut().find(|(known, _)| *known == name) {
            Some((_, points)) => points.push(point),
            None => lines.push((name, vec![point])),
        }
    }
    lines
        .into_iter()
        .map(|(name, points)| Line { name, points })
        .collect()
}

/// The ceiling by block size: the highest measured for any shape of that block size (the
/// ceiling of a TCP stream grows with the batch; memcpy's does not depend on it).
fn ceiling_line(rows: &[ShapeResult]) -> Line {
    let mut points: Vec<(f64, f64)> = Vec::new();
    for row in rows {
        let block = log2(row.shape.block);
        match points.iter_mut().find(|(known, _)| *known == block) {
            Some((_, gbps)) => *gbps = gbps.max(row.ceiling.gbps),
            None => points.push((block, row.ceiling.gbps)),
        }
    }
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    Line {
        name: "ceiling (same run)".into(),
        points,
    }
}

/// The x axis is log2 of the block size: a log scale whose labels fall on powers of two.
fn log2(block: u64) -> f64 {
    (block as f64).log2()
}

/// The block size at `x` on the axis, as people read it.
fn block_label(x: &f64) -> String {
    format_size(2f64.powf(*x).round() as u64)
}

/// The block sizes' range on the axis, half a power of two wider on each side.
fn block_range(rows: &[ShapeResult]) -> std::ops::Range<f64> {
    let (low, high) = rows
        .iter()
        .map(|row| log2(row.shape.block))
        .fold((f64::MAX, f64::MIN), |(low, high), x| {
            (low.min(x), high.max(x))
        });
    if low > high {
        return 0.0..1.0;
    }
    (low - 0.5)..(high + 0.5)
}
