/**
 * How the run view's lightbox ("open full size") draws a picture. A node's picture may be smaller
 * than its thumbnail (a 64x64 VAE decode): drawn at its own size it read as shrunk, so a small
 * picture is enlarged by a whole factor (with pixelated rendering each pixel stays a crisp square)
 * until its longer side reaches `ZOOM_MIN_SIDE`, as far as the room allows. A picture already that
 * large is drawn at its own size, and the lightbox's CSS bounds shrink one larger than the room.
 */

export interface Size {
  width: number;
  height: number;
}

/** The longer side, in CSS pixels, a small picture is enlarged to (when the room allows). */
export const ZOOM_MIN_SIDE = 512;

/** The whole factor the lightbox draws a picture of `natural` size by, in `room` (both in px): >= 1. */
export function zoomFactor(natural: Size, room: Size, minSide = ZOOM_MIN_SIDE): number {
  const longer = Math.max(natural.width, natural.height);
  if (!(longer > 0) || !(natural.width > 0) || !(natural.height > 0)) return 1;
  const wanted = Math.ceil(minSide / longer);
  const fits = Math.floor(Math.min(room.width / natural.width, room.height / natural.height));
  return Math.max(1, Math.min(wanted, fits));
}
