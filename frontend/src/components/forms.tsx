/**
 * Inputs that commit on blur or Enter (one undo step per edit, not per keystroke), and a
 * form generated from a JSON Schema (a node kind's or role kind's parameters).
 */
import { type InputHTMLAttributes, useEffect, useState } from "react";
import { parseUserJson } from "../api/json";
import type { JsonSchema } from "../api/types";

type CommitInputProps = Omit<InputHTMLAttributes<HTMLInputElement>, "value" | "onChange"> & {
  value: string;
  onCommit: (value: string) => void;
  /** Returns an error message for a draft that must not be committed. */
  check?: (value: string) => string | null;
};

export function CommitInput({ value, onCommit, check, className, ...rest }: CommitInputProps) {
  const [draft, setDraft] = useState(value);
  useEffect(() => setDraft(value), [value]);
  const error = draft !== value && check ? check(draft) : null;
  const commit = () => {
    if (draft === value) return;
    if (check?.(draft)) return;
    onCommit(draft);
  };
  return (
    <>
      <input
        {...rest}
        className={`${className ?? ""}${error ? " invalid" : ""}`}
        value={draft}
        onChange={(e) => setDraft(e.target.value)}
        onBlur={() => {
          commit();
          if (check?.(draft)) setDraft(value);
        }}
        onKeyDown={(e) => {
          if (e.key === "Enter") commit();
          if (e.key === "Escape") setDraft(value);
        }}
      />
      {error && <span className="field-error">{error}</span>}
    </>
  );
}

export function CommitTextArea({
  value,
  onCommit,
  ...rest
}: { value: string; onCommit: (v: string) => void } & Omit<
  React.TextareaHTMLAttributes<HTMLTextAreaElement>,
  "value" | "onChange"
>) {
  const [draft, setDraft] = useState(value);
  useEffect(() => setDraft(value), [value]);
  return (
    <textarea
      {...rest}
      value={draft}
      onChange={(e) => setDraft(e.target.value)}
      onBlur={() => draft !== value && onCommit(draft)}
    />
  );
}

/** A JSON value in a text box; parse errors are shown and never committed. */
export function JsonInput({
  value,
  onCommit,
  rows = 3,
  placeholder,
  label,
}: {
  value: unknown;
  onCommit: (v: unknown) => void;
  rows?: number;
  placeholder?: string;
  label?: string;
}) {
  const text = value === undefined ? "" : JSON.stringify(value, null, value && typeof value === "object" ? 2 : 0);
  const [draft, setDraft] = useState(text);
  const [error, setError] = useState<string | null>(null);
  useEffect(() => {
    setDraft(text);
    setError(null);
  }, [text]);
  return (
    <>
      <textarea
        className={`mono${error ? " invalid" : ""}`}
        rows={rows}
        value={draft}
        placeholder={placeholder}
        aria-label={label}
        onChange={(e) => setDraft(e.target.value)}
        onBlur={() => {
          if (draft === text) return;
          if (draft.trim() === "") {
            setError(null);
            onCommit(undefined);
            return;
          }
          try {
            onCommit(parseUserJson(draft));
            setError(null);
          } catch (err) {
            setError(err instanceof SyntaxError ? `Not JSON: ${err.message}` : (err as Error).message);
          }
        }}
      />
      {error && <span className="field-error">{error}</span>}
    </>
  );
}

function typeOf(schema: JsonSchema): string | undefined {
  return Array.isArray(schema.type) ? schema.type.find((t) => t !== "null") : schema.type;
}

function bounds(schema: JsonSchema): string {
  const parts: string[] = [];
  if (schema.minimum !== undefined) parts.push(`≥ ${schema.minimum}`);
  if (schema.exclusiveMinimum !== undefined) parts.push(`> ${schema.exclusiveMinimum}`);
  if (schema.maximum !== undefined) parts.push(`≤ ${schema.maximum}`);
  if (schema.exclusiveMaximum !== undefined) parts.push(`< ${schema.exclusiveMaximum}`);
  return parts.join(", ");
}

function SchemaField({
  name,
  schema,
  value,
  onChange,
}: {
  name: string;
  schema: JsonSchema;
  value: unknown;
  onChange: (v: unknown) => void;
}) {
  const type = typeOf(schema);
  const fallback = schema.default;
  const hint = [schema.description, bounds(schema)].filter(Boolean).join(" · ");
  let control: React.ReactNode;
  if (schema.enum) {
    control = (
      <select value={value === undefined ? "" : String(value)} onChange={(e) => onChange(e.target.value || undefined)}>
        <option value="">{fallback !== undefined ? `default (${String(fallback)})` : "—"}</option>
        {schema.enum.map((v) => (
          <option key={String(v)} value={String(v)}>
            {String(v)}
          </option>
        ))}
      </select>
    );
  } else if (type === "boolean") {
    const checked = value === undefined ? Boolean(fallback) : Boolean(value);
    control = (
      <span className="check-row">
        <input type="checkbox" checked={checked} onChange={(e) => onChange(e.target.checked)} />
        <span className="muted small">{value === undefined ? "default" : checked ? "on" : "off"}</span>
      </span>
    );
  } else if (type === "integer" || type === "number") {
    control = (
      <CommitInput
        type="number"
        step={type === "integer" ? 1 : "any"}
        value={value === undefined ? "" : String(value)}
        placeholder={fallback !== undefined ? String(fallback) : ""}
        onCommit={(v) => onChange(v === "" ? undefined : type === "integer" ? parseInt(v, 10) : parseFloat(v))}
        check={(v) =>
          v === "" || (type === "integer" ? /^-?\d+$/.test(v) : !Number.isNaN(Number(v))) ? null : `a ${type}`
        }
      />
    );
  } else if (type === "string") {
    control = (
      <CommitInput
        value={typeof value === "string" ? value : ""}
        placeholder={fallback !== undefined ? String(fallback) : ""}
        onCommit={(v) => onChange(v === "" ? undefined : v)}
      />
    );
  } else if (type === "array" && schema.items && ["string", "integer", "number"].includes(typeOf(schema.items) ?? "")) {
    const itemType = typeOf(schema.items);
    control = (
      <CommitInput
        value={Array.isArray(value) ? value.join(", ") : ""}
        placeholder="comma-separated"
        onCommit={(v) => {
          const items = v
            .split(",")
            .map((s) => s.trim())
            .filter(Boolean);
          onChange(items.length === 0 ? undefined : itemType === "string" ? items : items.map(Number));
        }}
      />
    );
  } else {
    control = <JsonInput value={value} onCommit={onChange} rows={2} placeholder="JSON value" label={name} />;
  }
  return (
    <div className="field" data-testid={`param-${name}`}>
      <span className="field-label">
        {name}
        {value !== undefined && (
          <button type="button" className="link small" onClick={() => onChange(undefined)} title="Use the default">
            reset
          </button>
        )}
      </span>
      {control}
      {hint && <span className="field-hint">{hint}</span>}
    </div>
  );
}

/** A form for an object schema: one field per property; a free-form object is a JSON box. */
export function SchemaForm({
  schema,
  value,
  onChange,
  emptyText = "No parameters.",
}: {
  schema: JsonSchema;
  value: Record<string, unknown>;
  onChange: (v: Record<string, unknown>) => void;
  emptyText?: string;
}) {
  const props = schema.properties;
  if (!props) {
    if (schema.additionalProperties === false) return <p className="muted small">{emptyText}</p>;
    return (
      <div className="field">
        {schema.description && <span className="field-hint">{schema.description}</span>}
        <JsonInput
          value={Object.keys(value).length ? value : undefined}
          rows={3}
          placeholder='{"name": value}'
          label="parameters (JSON object)"
          onCommit={(v) => onChange(v && typeof v === "object" && !Array.isArray(v) ? (v as Record<string, unknown>) : {})}
        />
      </div>
    );
  }
  const names = Object.keys(props);
  if (names.length === 0) return <p className="muted small">{emptyText}</p>;
  return (
    <div className="schema-form">
      {names.map((name) => (
        <SchemaField
          key={name}
          name={name}
          schema={props[name]}
          value={value[name]}
          onChange={(v) => {
            const next = { ...value };
            if (v === undefined) delete next[name];
            else next[name] = v;
            onChange(next);
          }}
        />
      ))}
    </div>
  );
}
