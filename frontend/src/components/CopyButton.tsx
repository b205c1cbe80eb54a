/** A button that copies a text to the clipboard, and a code block with one. */
import { useState } from "react";
import { Icon } from "./icons";

async function copyText(text: string): Promise<void> {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  // Plain http on another host than localhost has no clipboard API: copy through a selection.
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused to copy");
}

type CopyState = "idle" | "copied" | "failed";

/** Copy `text` to the clipboard on `copy()`; `state` says how that went for 2 s after. */
function useCopy(text: string): { state: CopyState; copy: () => Promise<void> } {
  const [state, setState] = useState<CopyState>("idle");
  const copy = async () => {
    try {
      await copyText(text);
      setState("copied");
    } catch {
      setState("failed");
    }
    window.setTimeout(() => setState("idle"), 2000);
  };
  return { state, copy };
}

export function CopyButton({ text, label = "Copy", testId }: { text: string; label?: string; testId?: string }) {
  const { state, copy } = useCopy(text);
  return (
    <button
      type="button"
      className={`btn btn-secondary btn-sm copy-btn${state === "copied" ? " copied" : ""}`}
      data-testid={testId}
      onClick={copy}
    >
      <Icon name={state === "copied" ? "check" : "copy"} size={14} />
      {state === "copied" ? "Copied" : state === "failed" ? "Select and copy" : label}
    </button>
  );
}

/** A copy button the size of a line of small text, for an id in a table or a sentence; `label` is its tooltip. */
export function CopyIconButton({ text, label, testId }: { text: string; label: string; testId?: string }) {
  const { state, copy } = useCopy(text);
  const title = state === "copied" ? "Copied" : state === "failed" ? "The browser refused: select and copy" : label;
  return (
    <button
      type="button"
      className={`icon-btn copy-icon-btn${state === "copied" ? " copied" : ""}`}
      data-testid={testId}
      data-state={state}
      title={title}
      aria-label={title}
      onClick={(e) => {
        e.stopPropagation(); // a click on the id's button is not a click on its row or node
        void copy();
      }}
    >
      <Icon name={state === "copied" ? "check" : "copy"} size={12} />
    </button>
  );
}

/** Code to paste somewhere, with a copy button in its corner. */
export function CopyBlock({ text, testId }: { text: string; testId?: string }) {
  return (
    <div className="copy-block">
      <pre className="code-block" data-testid={testId}>
        {text}
      </pre>
      <CopyButton text={text} testId={testId ? `${testId}-copy` : undefined} />
    </div>
  );
}
