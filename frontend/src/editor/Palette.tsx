/** The node kinds of this installation, grouped by category; drag one onto the canvas (or click). */
import { useMemo, useState } from "react";
import type { NodeKind } from "../api/types";
import { Icon } from "../components/icons";

export const DRAG_MIME = "application/x-omniflow-kind";

const CATEGORY_LABEL: Record<string, string> = { io: "Inputs & outputs", general: "Functions", model: "Models" };
const CATEGORY_ORDER = ["io", "general", "model"];

export function Palette({
  kinds,
  onAdd,
  open = true,
  onToggle,
}: {
  kinds: NodeKind[];
  onAdd: (kind: NodeKind) => void;
  /** Folded, it is a narrow rail with a button to unfold it (the canvas takes the room). */
  open?: boolean;
  onToggle?: () => void;
}) {
  const [filter, setFilter] = useState("");
  const groups = useMemo(() => {
    const f = filter.toLowerCase();
    const by = new Map<string, NodeKind[]>();
    for (const k of kinds) {
      if (f && !k.name.toLowerCase().includes(f) && !k.description.toLowerCase().includes(f)) continue;
      if (!by.has(k.category)) by.set(k.category, []);
      by.get(k.category)!.push(k);
    }
    const rank = (c: string) => (CATEGORY_ORDER.includes(c) ? CATEGORY_ORDER.indexOf(c) : CATEGORY_ORDER.length);
    return [...by.entries()].sort((a, b) => rank(a[0]) - rank(b[0]) || a[0].localeCompare(b[0]));
  }, [kinds, filter]);

  if (!open) {
    return (
      <aside className="panel-rail" aria-label="Node kinds (folded)">
        <button
          type="button"
          className="icon-btn"
          title="Show the node kinds"
          aria-label="Show the node kinds"
          onClick={onToggle}
          data-testid="palette-toggle"
        >
          <Icon name="plus" />
        </button>
        <span className="rail-label">Nodes</span>
      </aside>
    );
  }
  return (
    <aside className="palette" aria-label="Node kinds">
      <div className="panel-title palette-head">
        <span>Nodes</span>
        {onToggle && (
          <button
            type="button"
            className="icon-btn"
            title="Fold the node kinds (more room for the graph)"
            aria-label="Fold the node kinds"
            onClick={onToggle}
            data-testid="palette-fold"
          >
            <Icon name="chevron" size={14} style={{ transform: "rotate(180deg)" }} />
          </button>
        )}
      </div>
      <div className="search compact">
        <Icon name="search" size={14} />
        <input placeholder="Filter" value={filter} onChange={(e) => setFilter(e.target.value)} aria-label="Filter node kinds" />
      </div>
      {groups.map(([category, items]) => (
        <section key={category} className="palette-group">
          <div className="palette-cat">{CATEGORY_LABEL[category] ?? category}</div>
          {items.map((k) => (
            <div
              key={k.name}
              className={`palette-item cat-${category}`}
              draggable
              data-testid={`palette-${k.name}`}
              title={`${k.description}\nDrag onto the canvas, or click to add.`}
              onDragStart={(e) => {
                e.dataTransfer.setData(DRAG_MIME, k.name);
                e.dataTransfer.effectAllowed = "move";
              }}
              onClick={() => onAdd(k)}
              role="button"
              tabIndex={0}
              onKeyDown={(e) => e.key === "Enter" && onAdd(k)}
            >
              <div className="palette-name">{k.name}</div>
              <div className="palette-desc">{k.description}</div>
              <div className="palette-ports">
                {k.inputs === null ? (
                  <span className="muted">declares its ports</span>
                ) : (
                  <>
                    {Object.entries(k.inputs).map(([n, p]) => (
                      <span key={`i${n}`} className={`type type-${p.type}`}>
                        {n}
                      </span>
                    ))}
                    {Object.keys(k.inputs).length > 0 && Object.keys(k.outputs ?? {}).length > 0 && (
                      <span className="muted">→</span>
                    )}
                    {Object.entries(k.outputs ?? {}).map(([n, p]) => (
                      <span key={`o${n}`} className={`type type-${p.type}`}>
                        {n}
                      </span>
                    ))}
                  </>
                )}
              </div>
            </div>
          ))}
        </section>
      ))}
      {groups.length === 0 && <p className="muted small pad">No kind matches.</p>}
    </aside>
  );
}
