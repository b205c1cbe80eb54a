/**
 * A card whose table scrolls sideways inside it when the window is too narrow for its columns,
 * instead of running past the card's edge. The side that hides columns fades, so a reader sees
 * there is more; the frame says which sides do in `data-hidden-left` / `data-hidden-right`.
 */
import { type ReactNode, useCallback, useLayoutEffect, useRef, useState } from "react";
import { type HiddenSides, hiddenSides } from "./scrollCue";

export function ScrollTable({ children, className, testId }: { children: ReactNode; className?: string; testId?: string }) {
  const scroller = useRef<HTMLDivElement>(null);
  const [hidden, setHidden] = useState<HiddenSides>({ left: false, right: false });
  const measure = useCallback(() => {
    const el = scroller.current;
    if (!el) return;
    const next = hiddenSides(el);
    setHidden((h) => (h.left === next.left && h.right === next.right ? h : next));
  }, []);
  useLayoutEffect(() => {
    const el = scroller.current;
    if (!el) return;
    measure();
    // The scroller's width follows the window; the table's follows its rows (workers come and go).
    const observer = new ResizeObserver(measure);
    observer.observe(el);
    if (el.firstElementChild) observer.observe(el.firstElementChild);
    return () => observer.disconnect();
  }, [measure]);
  return (
    <div
      className={`card scroll-table${className ? ` ${className}` : ""}`}
      data-hidden-left={hidden.left}
      data-hidden-right={hidden.right}
      data-testid={testId}
    >
      <div className="scroll-table-body" ref={scroller} onScroll={measure}>
        {children}
      </div>
    </div>
  );
}
