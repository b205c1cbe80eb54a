/**
 * The y scale of a chart whose top follows its data (memory, occupancy): it starts at `min` and ends
 * on a labelled tick a step above the highest value, so the line always stays under the top label
 * (a top at 1.15x the value left the line above the last tick whenever the ticks were sparse).
 */
export interface NiceScale {
  top: number;
  step: number;
}

/** Least room between the highest value and the top tick, as a share of the value. */
const HEADROOM = 0.05;

/**
 * A 1, 2 or 5 times a power of ten step (counted in `unit`s: pass 1024 ** k for bytes, so steps
 * read 50 MiB rather than 52.4 MB) giving at most about `ticks` steps up to `max`, and the top: the
 * first multiple of the step above `max` with some headroom. An empty or all-zero series gets one
 * `unit` of scale.
 */
export function niceScale(max: number, ticks: number, unit = 1, min = 0): NiceScale {
  if (!(max > min)) return { top: min + unit, step: unit };
  const raw = (max - min) / unit / Math.max(1, ticks);
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].find((m) => m * magnitude >= raw)! * magnitude * unit;
  const top = min + Math.ceil(((max - min) * (1 + HEADROOM)) / step) * step;
  return { top, step };
}

/** The binary unit a byte count reads in (1 KiB, 1 MiB, 1 GiB, ...), for `niceScale`. */
export function byteUnit(max: number): number {
  return max >= 1024 ? 1024 ** Math.floor(Math.log(max) / Math.log(1024)) : 1;
}

/** The ticks from `min` to `top` every `step` (what the axis labels). */
export function ticksOf(min: number, { top, step }: NiceScale): number[] {
  const count = Math.round((top - min) / step);
  return Array.from({ length: count + 1 }, (_, i) => min + i * step);
}

/** How a time axis labels its ticks ("10:52:00 PM" in en-US). */
export function timeLabel(seconds: number): string {
  return new Date(seconds * 1000).toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

/** Times whose labels are among the widest a time axis writes (two-digit hours, 8s), whatever the locale's clock. */
export const WIDE_TIMES = [new Date(2000, 0, 1, 22, 58, 58), new Date(2000, 0, 1, 10, 58, 58)].map((d) => d.getTime() / 1000);

/**
 * The room a time axis needs right of the plot: a tick's label is centred on it, so the newest tick,
 * at the plot's right end, has half its label past that end; with less room (uPlot leaves half a y
 * axis, 25 px) its label is cut ("10:52:00 P"). `measure` gives a label's width in CSS px.
 */
export function timeAxisRightPad(measure: (label: string) => number): number {
  const widest = Math.max(...WIDE_TIMES.map((t) => measure(timeLabel(t))));
  return Math.ceil(widest / 2) + 2;
}
