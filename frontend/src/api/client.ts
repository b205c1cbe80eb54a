/**
 * fetch() for the studio's API: session cookie auth, the CSRF token on writes, and
 * every error response (`{"error", "details"}`) raised as an ApiError.
 */

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly details: unknown[] = [],
  ) {
    super(message);
    this.name = "ApiError";
  }
}

let csrfToken = "";
let onUnauthorized: (() => void) | null = null;

/** The token from the last session response; the cookie wins when it is readable. */
export function setCsrfToken(token: string): void {
  csrfToken = token;
}

/** Called when a request answers 401 (the session ended): the app goes to the login page. */
export function setUnauthorizedHandler(handler: (() => void) | null): void {
  onUnauthorized = handler;
}

function csrf(): string {
  const cookie = document.cookie.split("; ").find((c) => c.startsWith("csrftoken="));
  return cookie ? decodeURIComponent(cookie.slice("csrftoken=".length)) : csrfToken;
}

export interface RequestOptions {
  json?: unknown;
  form?: FormData;
  text?: { body: string; contentType: string };
  signal?: AbortSignal;
  /** Statuses that resolve to `null` instead of raising (e.g. 404 for optional endpoints). */
  allow?: number[];
}

export async function request<T>(method: string, path: string, options: RequestOptions = {}): Promise<T> {
  const headers: Record<string, string> = { Accept: "application/json" };
  let body: BodyInit | undefined;
  if (options.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(options.json);
  } else if (options.form) {
    body = options.form;
  } else if (options.text) {
    headers["Content-Type"] = options.text.contentType;
    body = options.text.body;
  }
  if (method !== "GET" && method !== "HEAD") headers["X-CSRFToken"] = csrf();
  let response: Response;
  try {
    response = await fetch(path, { method, headers, body, credentials: "same-origin", signal: options.signal });
  } catch (err) {
    if ((err as Error).name === "AbortError") throw err;
    throw new ApiError(0, "The studio did not answer; check that it is running.");
  }
  if (options.allow?.includes(response.status)) return null as T;
  if (response.status === 204) return null as T;
  const type = response.headers.get("Content-Type") ?? "";
  const payload = type.includes("json") ? await response.json().catch(() => null) : await response.text();
  if (!response.ok) {
    if (response.status === 401 && onUnauthorized && !path.startsWith("/api/auth/")) onUnauthorized();
    const error = payload && typeof payload === "object" && "error" in payload ? String(payload.error) : "";
    const details = payload && typeof payload === "object" && Array.isArray(payload.details) ? payload.details : [];
    throw new ApiError(response.status, error || `${method} ${path} answered ${response.status}`, details);
  }
  return payload as T;
}

/** A human sentence for an error, with its details (validation issues, field errors). */
/** One detail of an API error as a person reads it: its message, after the field it names. */
function describeDetail(detail: unknown): string {
  if (typeof detail === "string") return detail;
  const { field, message } = detail as { field?: string; message?: string };
  if (message === undefined) return JSON.stringify(detail);
  return field ? `${field}: ${message}` : message;
}

export function describeError(err: unknown): string {
  if (err instanceof ApiError) {
    const details = err.details.map(describeDetail).slice(0, 5);
    return details.length ? `${err.message}: ${details.join("; ")}` : err.message;
  }
  return err instanceof Error ? err.message : String(err);
}

/** ws:// or wss:// URL of a path on this origin. */
export function wsUrl(path: string): string {
  const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${window.location.host}${path}`;
}
