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

export function CopyButton({ text, label = "Copy", testId }: { text: string; label?: string; testId?: string }) {
  const [state, setState] = useState<"idle" | "copied" | "failed">("idle");
  return (
    <button
      type="button"
      className={`btn btn-secondary btn-sm copy-btn${state === "copied" ? " copied" : ""}`}
      data-testid={testId}
      onClick={async () => {
        try {
          await copyText(text);
          setState("copied");
        } catch {
          setState("failed");
        }
        window.setTimeout(() => setState("idle"), 2000);
      }}
    >
      <Icon name={state === "copied" ? "check" : "copy"} size={14} />
      {state === "copied" ? "Copied" : state === "failed" ? "Select and copy" : label}
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
