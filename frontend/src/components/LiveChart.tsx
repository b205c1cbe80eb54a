/**
 * A uPlot time-series chart that follows its container's width and takes new data in place.
 * Its element says how many rows it holds and the time of the first (`data-points`,
 * `data-first`), each series' latest value (`data-value` on `<testId>-<label>`), and its y axis's
 * labels (`data-y-ticks` on `.chart-box`, "|"-separated: the axis itself is drawn on a canvas).
 */
import { useEffect, useRef } from "react";
import uPlot from "uplot";
import { niceScale, ticksOf, timeAxisRightPad, timeLabel } from "./chartScale";

/** The axes' font: uPlot's own, named here so that the time labels are measured in it. */
const AXIS_FONT = '12px system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "Noto Sans", sans-serif';

let measurer: CanvasRenderingContext2D | null = null;
/** A label's width in CSS px, drawn in the axes' font. */
function labelWidth(label: string): number {
  measurer ??= document.createElement("canvas").getContext("2d");
  if (!measurer) return 8 * label.length; // no 2D canvas: a generous guess
  measurer.font = AXIS_FONT;
  return measurer.measureText(label).width;
}

export interface ChartSeries {
  label: string;
  color: string;
}

export function LiveChart({
  title,
  series,
  data,
  format = (v) => String(v),
  tickFormat,
  yRange,
  yUnit,
  testId,
  height = 180,
  note,
  span,
  emptyNote = "No values in this range yet.",
}: {
  title: string;
  series: ChartSeries[];
  /** [times (epoch s), ...one array per series]; null where a series has no value. */
  data: (number | null)[][];
  format?: (v: number) => string;
  /** The y axis's labels, given the ticks' step (default: `format`, which may write close ticks alike). */
  tickFormat?: (v: number, step: number) => string;
  /** Fixed bounds; a null upper bound follows the data, ending on a labelled tick above it (`chartScale.ts`). */
  yRange?: [number, number | null];
  /** With a following upper bound: the unit the ticks step in, given the highest value (`byteUnit` for bytes). */
  yUnit?: (max: number) => number;
  testId?: string;
  height?: number;
  /** A line under the title (what the chart stands in for, say). */
  note?: string;
  /** The most seconds the time axis spans, ending at the newest row (default: all the rows). */
  span?: number;
  /** Said over the chart while no series has a value (an empty frame alone reads as broken). */
  emptyNote?: string;
}) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const formatRef = useRef(format);
  formatRef.current = format;
  const tickRef = useRef(tickFormat);
  tickRef.current = tickFormat;

  useEffect(() => {
    const el = box.current!;
    // About one labelled tick per 30 px of plot (the axes take ~50 px of the height).
    const ticks = Math.max(2, Math.floor((height - 50) / 30));
    const following = yRange && yRange[1] === null ? yRange[0] : null;
    const scaleOf = (max: number | null) => niceScale(max ?? 0, ticks, yUnit ? yUnit(max ?? 0) : 1, following ?? 0);
    let scale = scaleOf(null); // the last one the y range took: its ticks are the axis's
    const opts: uPlot.Options = {
      width: el.clientWidth || 400,
      height,
      legend: { show: false },
      cursor: { drag: { x: false, y: false } },
      // Room right of the plot for the newest time label, centred on the plot's end (else cut off).
      padding: [null, timeAxisRightPad(labelWidth), null, null],
      scales: {
        // The newest `span` seconds, or all the rows when they cover less (a young cluster's
        // charts stay readable instead of a sliver at the right edge).
        x: span ? { time: true, range: (_u, min, max) => [Math.min(Math.max(min, max - span), max - 1), max] } : { time: true },
        y: yRange
          ? {
              range: (_u, _min, max) => {
                if (yRange[1] !== null) return [yRange[0], yRange[1]];
                scale = scaleOf(max);
                return [yRange[0], scale.top];
              },
            }
          : { auto: true },
      },
      axes: [
        {
          stroke: "#667085",
          font: AXIS_FONT,
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#eef0f3" },
          space: 90,
          values: (_u, vals) => vals.map(timeLabel),
        },
        {
          stroke: "#667085",
          font: AXIS_FONT,
          grid: { stroke: "#eef0f3" },
          ticks: { stroke: "#eef0f3" },
          size: 70,
          // A following top is a tick (see `niceScale`): its label sits level with the top of the plot.
          ...(following !== null ? { splits: () => ticksOf(following, scale) } : {}),
          values: (_u, vals, _axis, _space, step) => {
            // uPlot's `step` is its own tick spacing, not that of the splits above: labelled with it, 0.5%
            // steps read "0%, 1%, 1%, 2%, 2%".
            const spacing = following !== null ? scale.step : step;
            const labels = vals.map((v) => (tickRef.current ? tickRef.current(v, spacing) : formatRef.current(v)));
            el.dataset.yTicks = labels.join("|"); // what the axis reads, drawn on a canvas: for the browser tests
            return labels;
          },
        },
      ],
      series: [
        {},
        ...series.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: 2,
          fill: `${s.color}14`,
          spanGaps: false, // a null is a gap: no worker had the value then
          points: { show: false },
          value: (_u: uPlot, v: number | null) => (v === null || v === undefined ? "—" : formatRef.current(v)),
        })),
      ],
    };
    plot.current = new uPlot(opts, data as uPlot.AlignedData, el);
    const resize = new ResizeObserver(() => plot.current?.setSize({ width: el.clientWidth, height }));
    resize.observe(el);
    return () => {
      resize.disconnect();
      plot.current?.destroy();
      plot.current = null;
    };
    // The chart is rebuilt only when its series change; data flows in through setData.
  }, [series.map((s) => s.label).join("|"), height, span]);

  useEffect(() => {
    plot.current?.setData(data as uPlot.AlignedData);
  }, [data]);

  const latest = series.map((_, i) => {
    const column = data[i + 1] ?? [];
    for (let j = column.length - 1; j >= 0; j--) if (column[j] !== null && column[j] !== undefined) return column[j];
    return null;
  });

  return (
    <div
      className="chart card"
      data-testid={testId}
      data-points={data[0]?.length ?? 0}
      data-first={data[0]?.[0] ?? ""}
    >
      <div className="chart-head">
        <div className="chart-title">
          {title}
          {note && (
            <div className="chart-note muted small" data-testid={testId ? `${testId}-note` : undefined}>
              {note}
            </div>
          )}
        </div>
        <div className="chart-latest">
          {series.map((s, i) => (
            <span key={s.label} data-testid={testId ? `${testId}-${s.label}` : undefined} data-value={latest[i] ?? ""}>
              <span className="legend-dot" style={{ background: s.color }} />
              {s.label} <strong>{latest[i] === null ? "—" : format(latest[i]!)}</strong>
            </span>
          ))}
        </div>
      </div>
      <div className="chart-frame">
        <div ref={box} className="chart-box" />
        {latest.every((v) => v === null) && (
          <div className="chart-empty muted small" data-testid={testId ? `${testId}-empty` : undefined}>
            {emptyNote}
          </div>
        )}
      </div>
    </div>
  );
}
