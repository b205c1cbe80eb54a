/**
 * A picture over the page ("open full size"): enlarged by a whole factor when it is small
 * (`run/zoom.ts`), closed by a click anywhere or Escape.
 */
import { useEffect, useState } from "react";
import { type Size, zoomFactor } from "../run/zoom";

/** The lightbox's room for the picture: its CSS bounds (`.lightbox img`: 92vw x 84vh). */
const room = (): Size => ({ width: window.innerWidth * 0.92, height: window.innerHeight * 0.84 });

export function Lightbox({ name, url, onClose }: { name: string; url: string; onClose: () => void }) {
  const [natural, setNatural] = useState<Size | null>(null);
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      if (e.key === "Escape") onClose();
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [onClose]);
  const factor = natural ? zoomFactor(natural, room()) : 1;
  return (
    <div className="lightbox" role="dialog" aria-modal="true" aria-label={`${name} full size`} onClick={onClose} data-testid="lightbox">
      <img
        src={url}
        alt={`${name} full size`}
        data-testid="lightbox-image"
        data-zoom={factor}
        // Enlarged: a size that fits the room; else its own, which the CSS bounds shrink keeping its shape.
        style={natural && factor > 1 ? { width: natural.width * factor, height: natural.height * factor } : undefined}
        onLoad={(e) => setNatural({ width: e.currentTarget.naturalWidth, height: e.currentTarget.naturalHeight })}
      />
      <div className="lightbox-caption">
        {name}
        {natural && ` · ${natural.width}×${natural.height} px${factor > 1 ? `, shown ×${factor}` : ""}`} · click anywhere or
        press Esc to close
      </div>
    </div>
  );
}
