/** A few line icons (24x24, stroke), drawn inline so nothing loads at run time. */
import type { SVGProps } from "react";

/** A circle as a path (so every icon is one `d`). */
const c = (x: number, y: number, r: number) => `M${x - r} ${y}a${r} ${r} 0 1 0 ${2 * r} 0a${r} ${r} 0 1 0 ${-2 * r} 0`;

const paths: Record<string, string> = {
  flow: `${c(6, 6, 2.5)}${c(6, 18, 2.5)}${c(18, 12, 2.5)}M8.5 6.8l7 4M8.5 17.2l7-4`,
  play: "M7 5l12 7-12 7z",
  list: "M8 6h12M8 12h12M8 18h12M4 6h.01M4 12h.01M4 18h.01",
  server: "M4 5h16v6H4zM4 13h16v6H4zM8 8h.01M8 16h.01",
  plus: "M12 5v14M5 12h14",
  upload: "M12 16V4M7 9l5-5 5 5M4 20h16",
  download: "M12 4v12M7 11l5 5 5-5M4 20h16",
  trash: "M4 7h16M10 11v6M14 11v6M6 7l1 13h10l1-13M9 7V4h6v3",
  search: "M11 18a7 7 0 1 0 0-14 7 7 0 0 0 0 14zM21 21l-4.35-4.35",
  undo: "M9 14L4 9l5-5M4 9h11a5 5 0 0 1 0 10h-3",
  redo: "M15 14l5-5-5-5M20 9H9a5 5 0 0 0 0 10h3",
  layout: "M4 4h6v6H4zM14 14h6v6h-6zM10 7h4a2 2 0 0 1 2 2v5",
  save: "M5 4h11l3 3v13H5zM8 4v5h7V4M8 20v-6h8v6",
  history: "M3 12a9 9 0 1 0 3-6.7L3 8M3 3v5h5M12 7v5l3 3",
  rocket: "M5 15c-1.5 1.5-2 5-2 5s3.5-.5 5-2M9 15l-3-3 7-7c2-2 5-2 6-2 0 1 0 4-2 6zM13 9h.01",
  x: "M6 6l12 12M18 6L6 18",
  check: "M5 12l5 5L20 7",
  alert: "M12 9v4M12 17h.01M10.3 3.9L2 18a2 2 0 0 0 1.7 3h16.6a2 2 0 0 0 1.7-3L13.7 3.9a2 2 0 0 0-3.4 0z",
  logout: "M15 17l5-5-5-5M20 12H9M12 20H5V4h7",
  stop: "M7 7h10v10H7z",
  code: "M8 8l-4 4 4 4M16 8l4 4-4 4M14 5l-4 14",
  refresh: "M20 11a8 8 0 0 0-14.9-4M4 4v4h4M4 13a8 8 0 0 0 14.9 4M20 20v-4h-4",
  chevron: "M9 6l6 6-6 6",
  file: "M6 3h8l5 5v13H6zM14 3v5h5",
  cpu: "M7 7h10v10H7zM10 3v4M14 3v4M10 17v4M14 17v4M3 10h4M3 14h4M17 10h4M17 14h4",
  input: `M4 12h9M10 8l4 4-4 4${c(19, 12, 2.5)}`,
  copy: "M9 9h11v11H9zM5 15H4V4h11v1",
  key: `${c(7, 15, 4)}M10 12l9-9M16 6l3 3M14 8l2 2`,
  panel: "M4 4h16v16H4zM9 4v16",
  fit: "M4 9V4h5M15 4h5v5M20 15v5h-5M9 20H4v-5",
};

export type IconName = keyof typeof paths;

export function Icon({ name, size = 16, ...rest }: { name: IconName; size?: number } & SVGProps<SVGSVGElement>) {
  return (
    <svg
      width={size}
      height={size}
      viewBox="0 0 24 24"
      fill="none"
      stroke="currentColor"
      strokeWidth={2}
      strokeLinecap="round"
      strokeLinejoin="round"
      aria-hidden="true"
      {...rest}
    >
      <path d={paths[name]} />
    </svg>
  );
}
