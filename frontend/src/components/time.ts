/** How the studio writes a server timestamp: a readable date, how long ago, and the full instant. */

export interface DescribedTime {
  /** The date and time of day, the year only when it is not this year's: "Dec 6, 10:38 PM". */
  text: string;
  /** How long before `now`: "5 minutes ago", "yesterday". A time after `now` (the browser's clock
   * behind the server's) reads "just now", never "in 3 seconds". */
  relative: string;
  /** Weekday, date, time to the second and time zone: what a tooltip shows. */
  full: string;
}

export interface TimeFormat {
  locale?: string;
  /** IANA zone; default the browser's. */
  timeZone?: string;
}

const UNITS: [Intl.RelativeTimeFormatUnit, number][] = [
  // each unit with its length in seconds; a time is told in the largest unit it reaches 0.9 of
  ["minute", 60],
  ["hour", 3600],
  ["day", 86_400],
  ["month", 30 * 86_400],
  ["year", 365 * 86_400],
];

function relativeTo(seconds: number, locale: string | undefined): string {
  if (seconds < 45) return "just now"; // Intl's "now" reads as the time of day after a date
  let i = 0;
  while (i + 1 < UNITS.length && seconds >= UNITS[i + 1][1] * 0.9) i++;
  const [unit, length] = UNITS[i];
  return new Intl.RelativeTimeFormat(locale, { numeric: "auto" }).format(-Math.max(1, Math.round(seconds / length)), unit);
}

/** `iso` described as of `now`; null for a missing or unreadable timestamp. */
export function describeTime(iso: string | null | undefined, now: Date = new Date(),
                             { locale, timeZone }: TimeFormat = {}): DescribedTime | null {
  if (!iso) return null;
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return null;
  const year = new Intl.DateTimeFormat(locale, { year: "numeric", timeZone });
  const sameYear = year.format(d) === year.format(now);
  const text = d.toLocaleString(locale, {
    year: sameYear ? undefined : "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", timeZone,
  });
  const full = d.toLocaleString(locale, { dateStyle: "full", timeStyle: "long", timeZone });
  return { text, relative: relativeTo(Math.max(0, (now.getTime() - d.getTime()) / 1000), locale), full };
}
