//! Draws a fleet run's [`Timeline`] as SVG charts an operator can open in a browser:
//! latency, projector lag, throughput and per-process resources, each with the chaos markers
//! (kills, restarts) as labelled vertical lines so cause and effect line up by eye.
//!
//! Only the SVG backend is used: text is left to the viewer's fonts, so drawing needs no
//! system fonts and never fails for want of one. This module only reads the timeline; it
//! writes nothing but the chart files it names. Drawing and writing are blocking, so async
//! callers should run [`write_charts`] on a blocking task.

use std::error::Error as StdError;
use std::ops::Range;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::timeline::Timeline;

/// Why the charts could not be written. Both kinds name the file (or directory) involved.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    /// The chart directory could not be created or a chart file could not be written.
    #[error("failed to write {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// plotters refused to draw the chart (for example a layout that does not fit).
    #[error("failed to draw {path}")]
    Draw {
        path: PathBuf,
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

/// Writes latency.svg, lag.svg, throughput.svg and resources.svg into `dir`; returns the paths
/// written.
///
/// `dir` is created if missing and existing charts are overwritten. Missing values are drawn
/// as gaps, and a timeline without samples still yields every chart, with a note saying so.
pub fn write_charts(timeline: &Timeline, dir: &Path) -> Result<Vec<PathBuf>, ChartError> {
    std::fs::create_dir_all(dir).map_err(|source| ChartError::Io {
        path: dir.to_path_buf(),
        source,
    })?;

    let charts: [(&str, (u32, u32), DrawChart); 4] = [
        ("latency.svg", (WIDTH, PANEL_HEIGHT), draw_latency),
        ("lag.svg", (WIDTH, PANEL_HEIGHT), draw_lag),
        ("throughput.svg", (WIDTH, PANEL_HEIGHT), draw_throughput),
        ("resources.svg", (WIDTH, 2 * PANEL_HEIGHT), draw_resources),
    ];

    let mut written = Vec::with_capacity(charts.len());
    for (file_name, size, draw) in charts {
        let path = dir.join(file_name);
        let svg = match render_svg(size, |root| draw(root, timeline)) {
            Ok(svg) => svg,
            Err(source) => return Err(ChartError::Draw { path, source }),
        };
        if let Err(source) = std::fs::write(&path, svg) {
            return Err(ChartError::Io { path, source });
        }
        written.push(path);
    }
    Ok(written)
}

const WIDTH: u32 = 1200;
const PANEL_HEIGHT: u32 = 460;
/// Room kept right of each plot for the legend, so it never hides data or marker labels.
const LEGEND_WIDTH: u32 = 240;
const FONT: &str = "sans-serif";
const TIME_AXIS: &str = "time since load start (s)";

/// Tableau 10: ten hues that are easy to tell apart on a white background.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];
const MARKER_COLOR: RGBColor = RGBColor(178, 24, 43);
/// Marker labels cycle through this many rows so neighbouring markers do not overprint.
const MARKER_LABEL_ROWS: usize = 4;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), Box<dyn StdError + Send + Sync>>;
type DrawChart = fn(&Area<'_>, &Timeline) -> DrawResult;

/// One line on a panel, with one value per timeline sample.
struct Line {
    label: String,
    color: RGBColor,
    /// Dashed lines are the tail (p99) of a solid line's median.
    dashed: bool,
    values: Vec<Option<f64>>,
}

impl Line {
    fn new(label: impl Into<String>, color: RGBColor, values: Vec<Option<f64>>) -> Self {
        Self {
            label: label.into(),
            color,
            dashed: false,
            values,
        }
    }

    fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }

    fn style(&self) -> ShapeStyle {
        self.color.stroke_width(2)
    }
}

/// What one set of axes shows.
struct Panel<'a> {
    caption: &'a str,
    y_desc: &'a str,
    log_y: bool,
    lines: Vec<Line>,
}

fn render_svg(
    size: (u32, u32),
    draw: impl FnOnce(&Area<'_>) -> DrawResult,
) -> Result<String, Box<dyn StdError + Send + Sync>> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;
        draw(&root)?;
        root.present()?;
    }
    Ok(svg)
}

fn draw_latency(root: &Area<'_>, timeline: &Timeline) -> DrawResult {
    let (ack, visibility) = (PALETTE[0], PALETTE[1]);
    let panel = Panel {
        caption: "append ack and read-your-writes visibility latency",
        y_desc: "latency (ms, log scale)",
        log_y: true,
        lines: vec![
            Line::new("ack p50", ack, timeline.ack_p50_ms.clone()),
            Line::new("ack p99", ack, timeline.ack_p99_ms.clone()).dashed(),
            Line::new(
                "visibility p50",
                visibility,
                timeline.visibility_p50_ms.clone(),
            ),
            Line::new(
                "visibility p99",
                visibility,
                timeline.visibility_p99_ms.clone(),
            )
            .dashed(),
        ],
    };
    draw_panel(root, timeline, &panel)
}

fn draw_lag(root: &Area<'_>, timeline: &Timeline) -> DrawResult {
    let lines = timeline
        .lag_events
        .iter()
        .enumerate()
        .map(|(index, (projector, lag))| {
            let values = lag
                .iter()
                .map(|lag| lag.map(|events| events as f64))
                .collect();
            Line::new(projector.as_str(), palette(index), values)
        })
        .collect();
    let panel = Panel {
        caption: "projector lag behind the events stream",
        y_desc: "lag (events)",
        log_y: false,
        lines,
    };
    draw_panel(root, timeline, &panel)
}

fn draw_throughput(root: &Area<'_>, timeline: &Timeline) -> DrawResult {
    let every_second = |rates: &[f64]| rates.iter().copied().map(Some).collect();
    let panel = Panel {
        caption: "throughput",
        y_desc: "rate (per second)",
        log_y: false,
        lines: vec![
            Line::new(
                "appends/s",
                PALETTE[0],
                every_second(&timeline.appends_per_sec),
            ),
            Line::new(
                "queries/s",
                PALETTE[2],
                every_second(&timeline.queries_per_sec),
            ),
        ],
    };
    draw_panel(root, timeline, &panel)
}

fn draw_resources(root: &Area<'_>, timeline: &Timeline) -> DrawResult {
    // One colour per process across both panels, even if a process is missing from one.
    let mut processes: Vec<&str> = timeline
        .cpu_percent
        .keys()
        .chain(timeline.rss_mib.keys())
        .map(String::as_str)
        .collect();
    processes.sort_unstable();
    processes.dedup();
    let color_of = |process: &str| {
        let index = processes.binary_search(&process).unwrap_or_default();
        palette(index)
    };
    let lines_of = |series: &std::collections::BTreeMap<String, Vec<Option<f64>>>| {
        series
            .iter()
            .map(|(process, values)| Line::new(process.as_str(), color_of(process), values.clone()))
            .collect()
    };

    let root = root.titled("process resources", (FONT, 24))?;
    let (cpu_area, rss_area) = root.split_vertically(root.dim_in_pixel().1 / 2);
    let cpu = Panel {
        caption: "CPU per process",
        y_desc: "CPU (% of one core)",
        log_y: false,
        lines: lines_of(&timeline.cpu_percent),
    };
    let rss = Panel {
        caption: "resident memory per process",
        y_desc: "RSS (MiB)",
        log_y: false,
        lines: lines_of(&timeline.rss_mib),
    };
    draw_panel(&cpu_area, timeline, &cpu)?;
    draw_panel(&rss_area, timeline, &rss)
}

/// Draws axes, lines, markers and the legend column of one panel into `area`.
fn draw_panel(area: &Area<'_>, timeline: &Timeline, panel: &Panel<'_>) -> DrawResult {
    let (width, _) = area.dim_in_pixel();
    let (plot_area, legend_area) = area.split_horizontally(width.saturating_sub(LEGEND_WIDTH));
    let x_range = time_range(timeline);
    let values = || {
        panel
            .lines
            .iter()
            .flat_map(|line| finite_values(&line.values))
    };

    if panel.log_y {
        let y_range = log_value_range(values());
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(panel.caption, (FONT, 22))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x_range, y_range.clone().log_scale())?;
        chart
            .configure_mesh()
            .x_desc(TIME_AXIS)
            .y_desc(panel.y_desc)
            .x_label_formatter(&|value| format_tick(*value))
            .y_label_formatter(&|value| format_tick(*value))
            .label_style((FONT, 14))
            .draw()?;
        draw_lines_and_markers(&mut chart, timeline, panel, y_range)?;
    } else {
        let y_range = linear_value_range(values());
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(panel.caption, (FONT, 22))
            .margin(12)
            .x_label_area_size(48)
            .y_label_area_size(72)
            .build_cartesian_2d(x_range, y_range.clone())?;
        chart
            .configure_mesh()
            .x_desc(TIME_AXIS)
            .y_desc(panel.y_desc)
            .x_label_formatter(&|value| format_tick(*value))
            .y_label_formatter(&|value| format_tick(*value))
            .label_style((FONT, 14))
            .draw()?;
        draw_lines_and_markers(&mut chart, timeline, panel, y_range)?;
    }

    if values().next().is_none() {
        let (plot_width, plot_height) = plot_area.dim_in_pixel();
        let note = if timeline.t_secs.is_empty() {
            "no samples recorded"
        } else {
            "no values measured for this chart"
        };
        plot_area.draw(&Text::new(
            note,
            (plot_width as i32 / 2, plot_height as i32 / 2),
            (FONT, 20)
                .into_font()
                .color(&PALETTE[7])
                .pos(Pos::new(HPos::Center, VPos::Center)),
        ))?;
    }

    draw_legend(&legend_area, &panel.lines, &timeline.markers)
}

/// Draws each line as its unbroken runs (a `None` or non-finite value ends a run), then the
/// markers on top. Values outside `y_range` are clamped so a log axis can show zeros.
fn draw_lines_and_markers<Y>(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<RangedCoordf64, Y>>,
    timeline: &Timeline,
    panel: &Panel<'_>,
    y_range: Range<f64>,
) -> DrawResult
where
    Y: Ranged<ValueType = f64>,
{
    let clamp = |value: f64| value.clamp(y_range.start, y_range.end);
    for line in &panel.lines {
        for run in runs(&timeline.t_secs, &line.values) {
            let points: Vec<(f64, f64)> = run.into_iter().map(|(t, v)| (t, clamp(v))).collect();
            if let [point] = points[..] {
                // A lone value between gaps has no neighbour to join; show it as a dot.
                chart.draw_series(std::iter::once(Circle::new(point, 3, line.color.filled())))?;
            } else if line.dashed {
                chart.draw_series(DashedLineSeries::new(points, 8, 5, line.style()))?;
            } else {
                chart.draw_series(LineSeries::new(points, line.style()))?;
            }
        }
    }

    let label_style = (FONT, 13).into_font().color(&MARKER_COLOR);
    let x_range = chart.x_range();
    let flip_at = x_range.start + 0.75 * (x_range.end - x_range.start);
    for (index, (t, label)) in timeline.markers.iter().enumerate() {
        let t = *t;
        if !t.is_finite() {
            continue;
        }
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(t, y_range.start), (t, y_range.end)],
            MARKER_COLOR.mix(0.7).stroke_width(1),
        )))?;
        // Labels near the right edge hang left of their line so they stay on the chart.
        let (anchor, dx) = if t > flip_at {
            (HPos::Right, -4)
        } else {
            (HPos::Left, 4)
        };
        let dy = 4 + 16 * (index % MARKER_LABEL_ROWS) as i32;
        let style = label_style.pos(Pos::new(anchor, VPos::Top));
        chart.draw_series(std::iter::once(
            EmptyElement::at((t, y_range.end)) + Text::new(label.clone(), (dx, dy), style),
        ))?;
    }
    Ok(())
}

/// The legend column: a swatch and label per line, then the markers with their times.
fn draw_legend(area: &Area<'_>, lines: &[Line], markers: &[(f64, String)]) -> DrawResult {
    const ROW: i32 = 20;
    const SWATCH: i32 = 28;
    let text = (FONT, 14)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));

    let mut y = 60;
    for line in lines {
        let swatch = [(8, y), (8 + SWATCH, y)];
        if line.dashed {
            area.draw(&DashedPathElement::new(swatch, 7, 4, line.style()))?;
        } else {
            area.draw(&PathElement::new(swatch, line.style()))?;
        }
        area.draw(&Text::new(
            line.label.clone(),
            (SWATCH + 16, y),
            text.clone(),
        ))?;
        y += ROW;
    }

    if markers.is_empty() {
        return Ok(());
    }
    y += ROW / 2;
    area.draw(&PathElement::new(
        [(8 + SWATCH / 2, y - 7), (8 + SWATCH / 2, y + 7)],
        MARKER_COLOR.stroke_width(1),
    ))?;
    area.draw(&Text::new("markers", (SWATCH + 16, y), text.clone()))?;
    // List as many markers as fit above the bottom edge, keeping a row to say how many did not.
    let marker_text = text.color(&MARKER_COLOR);
    let (_, height) = area.dim_in_pixel();
    let rows_left = usize::try_from((height as i32 - y) / ROW - 1).unwrap_or(0);
    let listed = if markers.len() <= rows_left {
        markers.len()
    } else {
        rows_left.saturating_sub(1)
    };
    for (t, label) in &markers[..listed] {
        y += ROW;
        let entry = format!("{t:.0}s {label}");
        area.draw(&Text::new(entry, (16, y), marker_text.clone()))?;
    }
    if listed < markers.len() {
        y += ROW;
        let more = format!("… and {} more", markers.len() - listed);
        area.draw(&Text::new(more, (16, y), marker_text))?;
    }
    Ok(())
}

/// Pairs each sample time with its value and splits at every missing or non-finite value.
fn runs(t_secs: &[f64], values: &[Option<f64>]) -> Vec<Vec<(f64, f64)>> {
    let mut runs = Vec::new();
    let mut current = Vec::new();
    for (&t, value) in t_secs.iter().zip(values) {
        match value {
            Some(value) if value.is_finite() && t.is_finite() => current.push((t, *value)),
            _ if !current.is_empty() => runs.push(std::mem::take(&mut current)),
            _ => {}
        }
    }
    if !current.is_empty() {
        runs.push(current);
    }
    runs
}

fn finite_values(values: &[Option<f64>]) -> impl Iterator<Item = f64> + '_ {
    values
        .iter()
        .flatten()
        .copied()
        .filter(|value| value.is_finite())
}

/// Spans every sample and every marker, so a marker after the last sample is still drawn.
/// Never empty: one sample (or none) gets a span around it.
fn time_range(timeline: &Timeline) -> Range<f64> {
    let times = timeline
        .t_secs
        .iter()
        .chain(timeline.markers.iter().map(|(t, _)| t))
        .copied()
        .filter(|t| t.is_finite());
    let (start, end) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), t| {
        (lo.min(t), hi.max(t))
    });
    if start > end {
        return 0.0..1.0;
    }
    if start == end {
        return (start - 1.0).max(0.0)..end + 1.0;
    }
    start..end
}

/// From zero (or the lowest value if negative) to a little above the highest value.
fn linear_value_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (lo, hi) = values.fold((0.0_f64, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let hi = if hi > lo { hi * 1.1 } else { lo + 1.0 };
    lo..hi
}

/// Whole decades around the positive values; zeros are clamped onto the bottom of the axis.
fn log_value_range(values: impl Iterator<Item = f64>) -> Range<f64> {
    let (lo, hi) = values
        .filter(|v| *v > 0.0)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return 1.0..1000.0;
    }
    let lo = 10_f64.powf(lo.log10().floor());
    let hi = 10_f64.powf(hi.log10().ceil()).max(lo * 10.0);
    lo..hi
}

/// Tick labels without float noise: "0.1", "2.5", "1200".
fn format_tick(value: f64) -> String {
    if value.abs() >= 100.0 || value == value.round() {
        format!("{value:.0}")
    } else if value.abs() >= 1.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    }
}

fn palette(index: usize) -> RGBColor {
    PALETTE[index % PALETTE.len()]
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// Two minutes of a run where nats-server is killed at 60 s and back at 75 s: latency and
    /// lag go missing while it is down.
    fn chaos_timeline() -> Timeline {
        let samples = 120;
        let t_secs: Vec<f64> = (0..samples).map(f64::from).collect();
        let down = |t: f64| (60.0..75.0).contains(&t);
        let latency = |base: f64| -> Vec<Option<f64>> {
            t_secs
                .iter()
                .map(|&t| (!down(t)).then(|| base * (1.0 + (t / 10.0).sin().abs())))
                .collect()
        };
        let lag: Vec<Option<u64>> = t_secs
            .iter()
            .map(|&t| {
                (!down(t)).then(|| {
                    if t > 75.0 {
                        (900.0 - 8.0 * t).max(0.0) as u64
                    } else {
                        3
                    }
                })
            })
            .collect();
        let per_process = |scale: f64| -> BTreeMap<String, Vec<Option<f64>>> {
            ["engram", "nats-server", "projector"]
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    let values = t_secs
                        .iter()
                        .map(|&t| {
                            (!(*name == "nats-server" && down(t)))
                                .then_some(scale * (i as f64 + 1.0))
                        })
                        .collect();
                    (name.to_string(), values)
                })
                .collect()
        };
        let mut lag_events = BTreeMap::new();
        lag_events.insert("facts".to_owned(), lag.clone());
        lag_events.insert("vector".to_owned(), lag);
        // A lone value between gaps, to exercise the dot path.
        let mut visibility_p99 = latency(40.0);
        visibility_p99[59] = None;
        visibility_p99[57] = None;
        Timeline {
            appends_per_sec: t_secs
                .iter()
                .map(|&t| if down(t) { 0.0 } else { 950.0 })
                .collect(),
            queries_per_sec: vec![120.0; samples as usize],
            ack_p50_ms: latency(1.5),
            ack_p99_ms: latency(9.0),
            visibility_p50_ms: latency(6.0),
            visibility_p99_ms: visibility_p99,
            lag_events,
            cpu_percent: per_process(30.0),
            rss_mib: per_process(120.0),
            markers: vec![
                (60.0, "kill -9 nats-server".to_owned()),
                (75.0, "restart nats-server".to_owned()),
                (118.0, "stop load".to_owned()),
            ],
            t_secs,
        }
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|err| panic!("read {}: {err}", path.display()))
    }

    #[test]
    fn writes_four_charts_with_series_markers_and_labels() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_charts(&chaos_timeline(), dir.path()).unwrap();

        let names: Vec<_> = written
            .iter()
            .map(|path| path.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(
            names,
            ["latency.svg", "lag.svg", "throughput.svg", "resources.svg"]
        );
        for path in &written {
            let svg = read(path);
            assert!(svg.starts_with("<svg"), "{} is not an svg", path.display());
            assert!(svg.contains("<polyline"), "{} has no lines", path.display());
            assert!(
                svg.contains("kill -9 nats-server"),
                "{} lacks the marker label",
                path.display()
            );
            assert!(
                svg.contains("restart nats-server"),
                "{} lacks the marker label",
                path.display()
            );
            assert!(
                svg.contains(TIME_AXIS),
                "{} lacks the time axis",
                path.display()
            );
        }

        let latency = read(&written[0]);
        for label in [
            "ack p50",
            "ack p99",
            "visibility p50",
            "visibility p99",
            "latency (ms, log scale)",
        ] {
            assert!(latency.contains(label), "latency.svg lacks {label}");
        }
        // The outage splits every latency line in two.
        assert!(latency.matches("<polyline").count() >= 2 * 2);
        assert!(
            latency.contains("<circle"),
            "the lone visibility value is not drawn"
        );

        let lag = read(&written[1]);
        assert!(lag.contains("facts") && lag.contains("vector") && lag.contains("lag (events)"));

        let throughput = read(&written[2]);
        assert!(throughput.contains("appends/s") && throughput.contains("queries/s"));

        let resources = read(&written[3]);
        for label in [
            "CPU (% of one core)",
            "RSS (MiB)",
            "engram",
            "nats-server",
            "projector",
        ] {
            assert!(resources.contains(label), "resources.svg lacks {label}");
        }
    }

    #[test]
    fn empty_timeline_still_writes_every_chart_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let written = write_charts(&Timeline::default(), &dir.path().join("charts")).unwrap();

        assert_eq!(written.len(), 4);
        for path in &written {
            let svg = read(path);
            assert!(
                svg.contains("no samples recorded"),
                "{} has no note",
                path.display()
            );
            assert!(svg.contains(TIME_AXIS));
        }
    }

    #[test]
    fn degenerate_timelines_do_not_panic() {
        let one_sample = Timeline {
            t_secs: vec![5.0],
            appends_per_sec: vec![10.0],
            queries_per_sec: vec![0.0],
            ack_p50_ms: vec![Some(0.0)],
            ack_p99_ms: vec![Some(f64::NAN)],
            visibility_p50_ms: vec![None],
            visibility_p99_ms: vec![],
            markers: vec![(5.0, "kill -9 engram".to_owned())],
            ..Timeline::default()
        };
        let all_missing = Timeline {
            t_secs: vec![0.0, 1.0, 2.0],
            appends_per_sec: vec![0.0; 3],
            queries_per_sec: vec![0.0; 3],
            ack_p50_ms: vec![None; 3],
            ack_p99_ms: vec![None; 3],
            visibility_p50_ms: vec![None; 3],
            visibility_p99_ms: vec![None; 3],
            lag_events: BTreeMap::from([("facts".to_owned(), vec![None; 3])]),
            cpu_percent: BTreeMap::from([("engram".to_owned(), vec![None; 3])]),
            rss_mib: BTreeMap::from([("engram".to_owned(), vec![None; 3])]),
            markers: vec![],
        };
        for timeline in [one_sample, all_missing] {
            let dir = tempfile::tempdir().unwrap();
            let written = write_charts(&timeline, dir.path()).unwrap();
            assert_eq!(written.len(), 4);
        }
    }

    #[test]
    fn markers_that_do_not_fit_the_legend_are_counted() {
        let mut timeline = chaos_timeline();
        timeline.markers = (0..40)
            .map(|i| (f64::from(i) * 3.0, format!("kill -9 projector #{i}")))
            .collect();
        let dir = tempfile::tempdir().unwrap();

        let written = write_charts(&timeline, dir.path()).unwrap();

        let resources = read(&written[3]);
        assert!(
            resources.contains("kill -9 projector #39"),
            "a marker line lost its label"
        );
        assert!(
            resources.contains("more"),
            "the legend does not say markers were left out"
        );
    }

    #[test]
    fn unwritable_dir_names_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("not-a-dir");
        std::fs::write(&blocker, "").unwrap();

        let err = write_charts(&Timeline::default(), &blocker).unwrap_err();

        assert!(matches!(err, ChartError::Io { .. }));
        assert!(err.to_string().contains("not-a-dir"), "{err}");
    }

    #[test]
    fn runs_split_at_gaps_and_non_finite_values() {
        let t = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
        let values = [
            Some(1.0),
            Some(2.0),
            None,
            Some(f64::NAN),
            Some(4.0),
            Some(5.0),
        ];

        assert_eq!(
            runs(&t, &values),
            vec![vec![(0.0, 1.0), (1.0, 2.0)], vec![(4.0, 4.0), (5.0, 5.0)]]
        );
    }
}
