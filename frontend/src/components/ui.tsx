/** Small building blocks shared by the pages. */
import { type ReactNode, useEffect, useRef } from "react";
import { useNow } from "../hooks/useNow";
import { Icon, type IconName } from "./icons";
import { describeTime } from "./time";
import { useToastSlot } from "./toast";

export function Spinner({ label }: { label?: string }) {
  return (
    <span className="spinner-wrap" role="status">
      <span className="spinner" />
      {label && <span className="muted">{label}</span>}
    </span>
  );
}

type ButtonProps = React.ButtonHTMLAttributes<HTMLButtonElement> & {
  variant?: "primary" | "secondary" | "ghost" | "danger";
  icon?: IconName;
  small?: boolean;
};

export function Button({ variant = "secondary", icon, small, className, children, ...rest }: ButtonProps) {
  return (
    <button
      type="button"
      className={`btn btn-${variant}${small ? " btn-sm" : ""}${className ? ` ${className}` : ""}`}
      {...rest}
    >
      {icon && <Icon name={icon} size={small ? 14 : 16} />}
      {children}
    </button>
  );
}

export function Modal({
  title,
  onClose,
  children,
  footer,
  wide,
  testId,
}: {
  title: string;
  onClose: () => void;
  children: ReactNode;
  footer?: ReactNode;
  wide?: boolean;
  testId?: string;
}) {
  const ref = useRef<HTMLDivElement>(null);
  const toastSlot = useToastSlot();
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => e.key === "Escape" && onClose();
    window.addEventListener("keydown", onKey);
    ref.current?.querySelector<HTMLElement>("input, textarea, select")?.focus();
    return () => window.removeEventListener("keydown", onKey);
  }, [onClose]);
  return (
    <div className="modal-backdrop" onMouseDown={(e) => e.target === e.currentTarget && onClose()}>
      <div className={`modal${wide ? " modal-wide" : ""}`} role="dialog" aria-label={title} ref={ref} data-testid={testId}>
        <header className="modal-head">
          <h2>{title}</h2>
          <button type="button" className="icon-btn" onClick={onClose} aria-label="Close">
            <Icon name="x" />
          </button>
        </header>
        <div className="modal-body">{children}</div>
        {/* Notices shown while the dialog is open: in its flow, above the footer, covering none of it. */}
        <div className="modal-toasts" aria-live="polite" ref={toastSlot} data-testid="modal-toasts" />
        {footer && <footer className="modal-foot">{footer}</footer>}
      </div>
    </div>
  );
}

export function EmptyState({
  icon,
  title,
  children,
  action,
  testId,
}: {
  icon?: IconName;
  title: string;
  children?: ReactNode;
  action?: ReactNode;
  testId?: string;
}) {
  return (
    <div className="empty" data-testid={testId}>
      {icon && (
        <div className="empty-icon">
          <Icon name={icon} size={22} />
        </div>
      )}
      <h3>{title}</h3>
      {children && <div className="empty-text">{children}</div>}
      {action}
    </div>
  );
}

export function StatusBadge({ status }: { status: string }) {
  return (
    <span className={`badge status-${status}`} data-testid="status-badge">
      <span className="dot" />
      {status}
    </span>
  );
}

export function ErrorBox({ children }: { children: ReactNode }) {
  return (
    <div className="error-box" role="alert">
      <Icon name="alert" />
      <div>{children}</div>
    </div>
  );
}

export function Field({ label, hint, children }: { label: string; hint?: ReactNode; children: ReactNode }) {
  return (
    <label className="field">
      <span className="field-label">{label}</span>
      {children}
      {hint && <span className="field-hint">{hint}</span>}
    </label>
  );
}

export function formatMs(ms: number | null | undefined): string {
  if (ms === null || ms === undefined) return "";
  if (ms < 1) return `${ms.toFixed(2)} ms`;
  if (ms < 1000) return `${ms.toFixed(ms < 10 ? 1 : 0)} ms`;
  if (ms < 60_000) return `${(ms / 1000).toFixed(2)} s`;
  return `${Math.floor(ms / 60_000)} min ${Math.round((ms % 60_000) / 1000)} s`;
}

/** A timestamp in running text: its date and time of day (see `describeTime`). */
export function formatTime(iso: string | null | undefined): string {
  return describeTime(iso)?.text ?? "";
}

/** A server timestamp in a list: its date, how long ago (kept current) and, in its tooltip, the
 * full instant. Every list of the studio shows its times this way; where the "5 minutes ago" goes
 * depends on the room a list has: `inline` after the date, `below` it (rows two lines high anyway),
 * or only in the tooltip (`title`: rows that must keep one line in a narrow window). */
export function Timestamp({ iso, ago = "title" }: { iso: string | null | undefined; ago?: "inline" | "below" | "title" }) {
  const now = useNow(30_000);
  const time = describeTime(iso, now);
  if (!time) return null;
  return (
    <time className={`timestamp ago-${ago}`} dateTime={iso ?? undefined} title={`${time.full} (${time.relative})`}>
      <span className="timestamp-date">{time.text}</span>
      {ago !== "title" && (
        <span className="timestamp-ago">
          <span className="timestamp-sep"> · </span>
          {time.relative}
        </span>
      )}
    </time>
  );
}

export function formatBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
}

/** The page for an error: a 404 as "not found" with a way back, anything else as an error box. */
export function LoadError({ error, what, back }: { error: { status?: number; message: string }; what: string; back: ReactNode }) {
  if (error.status === 404) {
    return (
      <EmptyState icon="search" title={`No such ${what}`} action={back} testId="not-found">
        It does not exist, or it belongs to someone else.
      </EmptyState>
    );
  }
  return <ErrorBox>{error.message}</ErrorBox>;
}
