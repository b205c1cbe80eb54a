/** Which sides of a horizontally scrolling box hide content (where a table's scroll cue is drawn). */

export interface ScrollBox {
  scrollLeft: number;
  scrollWidth: number;
  clientWidth: number;
}

export interface HiddenSides {
  left: boolean;
  right: boolean;
}

/** Under a pixel of overflow is rounding (fractional column widths), not a hidden column. */
const SLACK = 1;

export function hiddenSides({ scrollLeft, scrollWidth, clientWidth }: ScrollBox): HiddenSides {
  return {
    left: scrollLeft > SLACK,
    right: scrollLeft + clientWidth < scrollWidth - SLACK,
  };
}
