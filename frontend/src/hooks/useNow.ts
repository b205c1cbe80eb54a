/** The browser's clock, read again every `everyMs`: what a "5 minutes ago" is measured from. */
import { useEffect, useState } from "react";

export function useNow(everyMs: number): Date {
  const [now, setNow] = useState(() => new Date());
  useEffect(() => {
    const timer = window.setInterval(() => setNow(new Date()), everyMs);
    return () => window.clearInterval(timer);
  }, [everyMs]);
  return now;
}
