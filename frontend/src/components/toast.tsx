/**
 * Transient notices: saved, refused connection, errors. In the corner of the page; while a dialog
 * is open, inside it just above its footer (`useToastSlot`), so a notice never covers the dialog's
 * buttons (a wide dialog reaches the corner where the notices are).
 */
import { createContext, type ReactNode, useCallback, useContext, useMemo, useRef, useState } from "react";
import { createPortal } from "react-dom";
import { Icon } from "./icons";

type Tone = "info" | "success" | "error";
interface Toast {
  id: number;
  tone: Tone;
  text: string;
}

interface ToastApi {
  push: (text: string, tone?: Tone) => void;
  /** Show the notices in `slot` until the function returned is called (the newest slot wins). */
  claim: (slot: HTMLElement) => () => void;
}

const ToastContext = createContext<ToastApi | null>(null);

export function ToastProvider({ children }: { children: ReactNode }) {
  const [toasts, setToasts] = useState<Toast[]>([]);
  const [slots, setSlots] = useState<HTMLElement[]>([]);
  const next = useRef(1);
  const push = useCallback((text: string, tone: Tone = "info") => {
    const id = next.current++;
    setToasts((t) => [...t.slice(-3), { id, tone, text }]);
    window.setTimeout(() => setToasts((t) => t.filter((x) => x.id !== id)), tone === "error" ? 8000 : 4000);
  }, []);
  const claim = useCallback((slot: HTMLElement) => {
    setSlots((s) => [...s, slot]);
    return () => setSlots((s) => s.filter((x) => x !== slot));
  }, []);
  const api = useMemo(() => ({ push, claim }), [push, claim]);
  const list = toasts.map((t) => (
    <div key={t.id} className={`toast toast-${t.tone}`} data-testid="toast">
      <Icon name={t.tone === "error" ? "alert" : t.tone === "success" ? "check" : "chevron"} />
      <span>{t.text}</span>
      <button type="button" className="icon-btn" aria-label="Dismiss" onClick={() => setToasts((all) => all.filter((x) => x.id !== t.id))}>
        <Icon name="x" size={14} />
      </button>
    </div>
  ));
  const slot = slots.at(-1);
  return (
    <ToastContext.Provider value={api}>
      {children}
      <div className="toasts" aria-live="polite">
        {slot ? null : list}
      </div>
      {slot && createPortal(list, slot)}
    </ToastContext.Provider>
  );
}

function useToastApi(): ToastApi {
  const api = useContext(ToastContext);
  if (!api) throw new Error("toasts used outside ToastProvider");
  return api;
}

export function useToast(): (text: string, tone?: Tone) => void {
  return useToastApi().push;
}

/** A ref callback for the element a dialog keeps for the notices while it is open. */
export function useToastSlot(): (el: HTMLElement | null) => void {
  const { claim } = useToastApi();
  const release = useRef<(() => void) | null>(null);
  return useCallback(
    (el: HTMLElement | null) => {
      release.current?.();
      release.current = el ? claim(el) : null;
    },
    [claim],
  );
}
