/**
 * The graph editor: palette, canvas, property panels; validation as you edit, undo/redo,
 * auto-layout, save as a new version, history with diffs, export, deploy, run.
 */
import {
  applyEdgeChanges,
  applyNodeChanges,
  Background,
  BackgroundVariant,
  type Connection,
  type EdgeChange,
  type FinalConnectionState,
  type NodeChange,
  Panel,
  ReactFlow,
  ReactFlowProvider,
  useReactFlow,
} from "@xyflow/react";
import { type DragEvent, useCallback, useEffect, useMemo, useRef, useState } from "react";
import { Link, useNavigate, useParams } from "react-router-dom";
import { type ApiError, describeError } from "../api/client";
import { catalogue, validateSpec, workflows } from "../api/studio";
import type { GraphSpec, Issue, ModelInfo, NodeKind, OpInfo, RoleKind, RoleSpec, Version, Workflow } from "../api/types";
import { FlowControls } from "../components/FlowControls";
import { FlowMiniMap } from "../components/FlowMiniMap";
import { Icon } from "../components/icons";
import { nodeTypes } from "../components/SpecNodeView";
import { useToast } from "../components/toast";
import { Button, ErrorBox, LoadError, Modal, Spinner } from "../components/ui";
import { LEGIBLE_ZOOM } from "../graph/viewport";
import { DeployDialog } from "../editor/DeployDialog";
import { NodeInspector, type NodeEdits } from "../editor/NodeInspector";
import { DRAG_MIME, Palette } from "../editor/Palette";
import { runGate } from "../editor/runGate";
import { SaveDialog } from "../editor/SaveDialog";
import { EdgeInspector, IssueList, RolesPanel, WorkflowPanel } from "../editor/SidePanels";
import { useReadableFit } from "../hooks/useReadableFit";
import { VersionHistory } from "../editor/VersionHistory";
import { jsonEqual } from "../graph/canonical";
import { placeIssues, withIssues } from "../graph/issues";
import { autoLayout } from "../graph/layout";
import { type EditorDoc, type SpecEdge, type SpecNode, docLayout, docToSpec, emptyDoc, specToDoc } from "../graph/model";
import {
  addNode,
  addRole,
  applyOp,
  checkConnection,
  connect,
  removeElements,
  removeRole,
  renameNode,
  setEdgeStream,
  setPorts,
  updateNodeSpec,
  updateRole,
} from "../graph/ops";
import { useHistory } from "../hooks/useHistory";

interface Loaded {
  workflow: Workflow;
  kinds: NodeKind[];
  roleKinds: RoleKind[];
  /** The registered ops a python node may name. */
  ops: OpInfo[];
  /** The models a role may name (built-in ones and checkpoints under the model roots). */
  models: ModelInfo[];
  version: Version | null;
}

export function EditorPage() {
  const { id } = useParams<{ id: string }>();
  const [loaded, setLoaded] = useState<Loaded | null>(null);
  const [error, setError] = useState<{ status?: number; message: string } | null>(null);

  useEffect(() => {
    if (!id) return;
    setLoaded(null);
    (async () => {
      try {
        const [workflow, kinds, roleKinds, ops, models] = await Promise.all([
          workflows.get(id),
          catalogue.nodeKinds(),
          catalogue.roleKinds(),
          catalogue.ops(),
          catalogue.models(),
        ]);
        const version = workflow.latest_version
          ? await workflows.version(id, workflow.latest_version.number)
          : null;
        setLoaded({ workflow, kinds, roleKinds, ops, models: models.models, version });
      } catch (err) {
        setError({ status: (err as ApiError).status, message: describeError(err) });
      }
    })();
  }, [id]);

  if (error) {
    return (
      <div className="page">
        <LoadError
          error={error}
          what="workflow"
          back={
            <Link className="btn btn-secondary" to="/workflows">
              All workflows
            </Link>
          }
        />
      </div>
    );
  }
  if (!loaded) {
    return (
      <div className="page">
        <Spinner label="Loading the editor" />
      </div>
    );
  }
  return (
    <ReactFlowProvider>
      <Editor key={loaded.workflow.id} {...loaded} />
    </ReactFlowProvider>
  );
}

type Tab = "inspect" | "roles" | "workflow" | "issues";

/** What a saved version holds, to tell whether the editor has unsaved changes. */
const savedKey = (spec: GraphSpec, layout: ReturnType<typeof docLayout>) => ({ spec, nodes: layout.nodes });

/** Below this window width the side panels start folded, so the canvas gets the room. */
const WIDE_WINDOW = 1280;

function Editor({ workflow, kinds, roleKinds, ops, models, version }: Loaded) {
  const navigate = useNavigate();
  const toast = useToast();
  const flow = useReactFlow<SpecNode, SpecEdge>();
  const catalogueMap = useMemo(() => new Map(kinds.map((k) => [k.name, k])), [kinds]);

  const initial = useMemo(
    () => (version ? specToDoc(version.spec, version.layout) : emptyDoc(workflow.name, workflow.description)),
    [version, workflow.name, workflow.description],
  );
  const history = useHistory<EditorDoc>(initial);
  const doc = history.present;
  const docRef = useRef(doc);
  docRef.current = doc;

  const [base, setBase] = useState<number | null>(version?.number ?? null);
  /** How many issues the saved version (`base`) has: Run runs that version, so they decide whether it may. */
  const [baseIssues, setBaseIssues] = useState(version?.issues.length ?? 0);
  /** Whether the saved version is a chat model (what its deployment's name also names on /v1). */
  const [baseChat, setBaseChat] = useState(version?.chat ?? false);
  const [saved, setSaved] = useState(() => savedKey(docToSpec(initial), docLayout(initial)));
  const spec = useMemo(() => docToSpec(doc), [doc]);
  const layoutNow = useMemo(() => docLayout(doc), [doc]);
  const dirty = !jsonEqual(savedKey(spec, layoutNow), saved);

  // ---------------------------------------------------------------- validation
  const [issues, setIssues] = useState<Issue[]>(version?.issues ?? []);
  const [validating, setValidating] = useState(false);
  /** Whether `issues` describes the document (a stale result is shown while the next check runs). */
  const [checked, setChecked] = useState(version !== null);
  const [validationError, setValidationError] = useState<string | null>(null);
  const specText = useMemo(() => JSON.stringify(spec), [spec]);
  useEffect(() => {
    const abort = new AbortController();
    setValidating(true);
    const timer = window.setTimeout(async () => {
      try {
        const found = await validateSpec(JSON.parse(specText) as GraphSpec, abort.signal);
        setIssues(found);
        setChecked(true);
        setValidationError(null);
      } catch (err) {
        if ((err as Error).name !== "AbortError") setValidationError(describeError(err));
      } finally {
        if (!abort.signal.aborted) setValidating(false);
      }
    }, 350);
    return () => {
      abort.abort();
      window.clearTimeout(timer);
    };
  }, [specText]);
  const placed = useMemo(() => placeIssues(issues, doc), [issues, doc]);
  const view = useMemo(() => withIssues(doc, placed), [doc, placed]);

  // ---------------------------------------------------------------- selection and panels
  const selectedNodes = doc.nodes.filter((n) => n.selected);
  const selectedEdges = doc.edges.filter((e) => e.selected);
  const selectedNode = selectedNodes.length === 1 && selectedEdges.length === 0 ? selectedNodes[0] : null;
  const selectedEdge = selectedEdges.length === 1 && selectedNodes.length === 0 ? selectedEdges[0] : null;
  const [tab, setTab] = useState<Tab>("workflow");
  const selectionKey = `${selectedNode?.id ?? ""}|${selectedEdge?.id ?? ""}`;
  // An empty graph starts with its palette open at any width: the canvas says to drag from it.
  const [paletteOpen, setPaletteOpen] = useState(() => window.innerWidth >= WIDE_WINDOW || initial.nodes.length === 0);
  const [panelOpen, setPanelOpen] = useState(() => window.innerWidth >= WIDE_WINDOW);
  useEffect(() => {
    if (selectedNode || selectedEdge) {
      setTab("inspect");
      setPanelOpen(true);
    }
    // Only a change of selection switches the tab, not edits of the selected node.
  }, [selectionKey]);
  const showTab = (t: Tab) => {
    setTab(t);
    setPanelOpen(true);
  };

  const select = useCallback(
    (nodeId: string | null) => {
      history.replace((d) => ({
        ...d,
        nodes: d.nodes.map((n) => (n.selected === (n.id === nodeId) ? n : { ...n, selected: n.id === nodeId })),
        edges: d.edges.map((e) => (e.selected ? { ...e, selected: false } : e)),
      }));
    },
    [history],
  );

  // ---------------------------------------------------------------- canvas events
  const onNodesChange = useCallback(
    (changes: NodeChange<SpecNode>[]) => {
      const removed = changes.filter((c) => c.type === "remove").map((c) => (c as { id: string }).id);
      const rest = changes.filter((c) => c.type !== "remove");
      if (rest.length) history.replace((d) => ({ ...d, nodes: applyNodeChanges(rest, d.nodes) }));
      if (removed.length) history.commit((d) => removeElements(d, removed, []));
    },
    [history],
  );
  const onEdgesChange = useCallback(
    (changes: EdgeChange<SpecEdge>[]) => {
      const removed = changes.filter((c) => c.type === "remove").map((c) => (c as { id: string }).id);
      const rest = changes.filter((c) => c.type !== "remove");
      if (rest.length) history.replace((d) => ({ ...d, edges: applyEdgeChanges(rest, d.edges) }));
      if (removed.length) history.commit((d) => removeElements(d, [], removed));
    },
    [history],
  );

  const [hint, setHint] = useState<string | null>(null);
  useEffect(() => {
    if (!hint) return;
    const t = window.setTimeout(() => setHint(null), 6000);
    return () => window.clearTimeout(t);
  }, [hint]);

  const onConnect = useCallback(
    (conn: Connection) => {
      const result = connect(docRef.current, conn);
      if ("hint" in result) setHint(result.hint);
      else {
        history.commit(result.doc);
        setHint(null);
      }
    },
    [history],
  );
  const isValidConnection = useCallback(
    (conn: Connection | SpecEdge) =>
      checkConnection(docRef.current, {
        source: conn.source,
        target: conn.target,
        sourceHandle: conn.sourceHandle ?? null,
        targetHandle: conn.targetHandle ?? null,
      }).ok,
    [],
  );
  const onConnectEnd = useCallback((_: MouseEvent | TouchEvent, state: FinalConnectionState) => {
    if (!state.toHandle || state.isValid !== false || !state.fromHandle) return;
    const [from, to] = state.fromHandle.type === "source" ? [state.fromHandle, state.toHandle] : [state.toHandle, state.fromHandle];
    const check = checkConnection(docRef.current, {
      source: from.nodeId,
      sourceHandle: from.id ?? null,
      target: to.nodeId,
      targetHandle: to.id ?? null,
    });
    if (!check.ok) setHint(check.hint);
  }, []);

  const dragStart = useRef<EditorDoc | null>(null);
  const onNodeDragStart = useCallback(() => {
    dragStart.current = docRef.current;
  }, []);
  const onNodeDragStop = useCallback(() => {
    const before = dragStart.current;
    dragStart.current = null;
    if (!before) return;
    const moved = docRef.current.nodes.some((n) => {
      const old = before.nodes.find((o) => o.id === n.id);
      return old && (old.position.x !== n.position.x || old.position.y !== n.position.y);
    });
    if (moved) history.record(before);
  }, [history]);

  const add = useCallback(
    (kind: NodeKind, position?: { x: number; y: number }) => {
      let at = position;
      if (!at) {
        const box = document.querySelector(".canvas")?.getBoundingClientRect();
        at = box
          ? flow.screenToFlowPosition({ x: box.left + box.width / 2 - 100, y: box.top + box.height / 2 - 40 })
          : { x: 0, y: 0 };
        at = { x: at.x + (docRef.current.nodes.length % 5) * 24, y: at.y + (docRef.current.nodes.length % 5) * 24 };
      }
      const result = addNode(docRef.current, kind, at);
      history.commit({
        ...result.doc,
        nodes: result.doc.nodes.map((n) => ({ ...n, selected: n.id === result.id })),
        edges: result.doc.edges.map((e) => (e.selected ? { ...e, selected: false } : e)),
      });
    },
    [flow, history],
  );

  const onDrop = useCallback(
    (e: DragEvent) => {
      e.preventDefault();
      const name = e.dataTransfer.getData(DRAG_MIME);
      const kind = catalogueMap.get(name);
      if (!kind) return;
      const p = flow.screenToFlowPosition({ x: e.clientX, y: e.clientY });
      add(kind, { x: p.x - 100, y: p.y - 30 });
    },
    [add, catalogueMap, flow],
  );

  const canvasRef = useRef<HTMLDivElement>(null);
  // A saved view too far out to read opens fitted readably instead.
  const savedView = version?.layout.viewport && version.layout.viewport.zoom >= LEGIBLE_ZOOM ? version.layout.viewport : undefined;
  const { fit } = useReadableFit(canvasRef, !savedView && initial.nodes.length > 0, "always");
  const layout = useCallback(() => {
    history.commit((d) => ({ ...d, nodes: autoLayout(d.nodes, d.edges) }));
    window.setTimeout(() => fit(300), 50);
  }, [fit, history]);

  // ---------------------------------------------------------------- edits from panels
  const nodeEdits: NodeEdits = useMemo(
    () => ({
      rename: (from, to) => {
        try {
          history.commit((d) => renameNode(d, from, to));
          return null;
        } catch (err) {
          return (err as Error).message;
        }
      },
      patch: (nodeId, patch) => history.commit((d) => updateNodeSpec(d, nodeId, patch)),
      setPorts: (nodeId, direction, ports, renames) =>
        history.commit((d) => setPorts(d, nodeId, direction, ports, renames)),
      addRole: (kind) => {
        const result = addRole(docRef.current, kind);
        history.commit(result.doc);
        return result.name;
      },
      applyOp: (nodeId, op) => history.commit((d) => applyOp(d, nodeId, op)),
      remove: (nodeId) => history.commit((d) => removeElements(d, [nodeId], [])),
    }),
    [history],
  );

  // ---------------------------------------------------------------- save, history, export
  const [saving, setSaving] = useState(false);
  const [showHistory, setShowHistory] = useState(false);
  const [showDeploy, setShowDeploy] = useState(false);
  const [showPython, setShowPython] = useState<string | null>(null);
  const [exportOpen, setExportOpen] = useState(false);

  const onSaved = (v: Version, created: boolean) => {
    setBase(v.number);
    setBaseIssues(v.issues.length);
    setBaseChat(v.chat);
    setSaved(savedKey(v.spec, docLayout(specToDoc(v.spec, v.layout))));
    toast(created ? `Saved version ${v.number}` : `No changes since version ${v.number}`, "success");
  };

  const openVersion = (v: Version) => {
    history.commit(specToDoc(v.spec, v.layout));
    setShowHistory(false);
    toast(`Opened version ${v.number}; saving makes it the newest version`, "info");
    window.setTimeout(() => fit(), 50);
  };

  // ---------------------------------------------------------------- keyboard
  useEffect(() => {
    const onKey = (e: KeyboardEvent) => {
      const target = e.target as HTMLElement;
      if (target.closest("input, textarea, select, [contenteditable]")) return;
      const mod = e.ctrlKey || e.metaKey;
      if (mod && e.key.toLowerCase() === "z" && !e.shiftKey) {
        e.preventDefault();
        history.undo();
      } else if (mod && (e.key.toLowerCase() === "y" || (e.key.toLowerCase() === "z" && e.shiftKey))) {
        e.preventDefault();
        history.redo();
      } else if (mod && e.key.toLowerCase() === "s") {
        e.preventDefault();
        setSaving(true);
      }
    };
    window.addEventListener("keydown", onKey);
    return () => window.removeEventListener("keydown", onKey);
  }, [history]);

  useEffect(() => {
    if (!dirty) return;
    const warn = (e: BeforeUnloadEvent) => e.preventDefault();
    // In-app links: ask before leaving unsaved edits (captured before the router's handler,
    // which does not navigate when the event was cancelled). Downloads leave nothing.
    const guard = (e: MouseEvent) => {
      const link = (e.target as HTMLElement).closest("a[href]");
      if (!link || link.hasAttribute("download") || link.getAttribute("target") === "_blank") return;
      if (!window.confirm("Leave the editor? Your unsaved changes will be lost.")) e.preventDefault();
    };
    window.addEventListener("beforeunload", warn);
    document.addEventListener("click", guard, true);
    return () => {
      window.removeEventListener("beforeunload", warn);
      document.removeEventListener("click", guard, true);
    };
  }, [dirty]);

  const issueCount = issues.length;
  const gate = runGate(base, baseIssues, dirty);
  const focusIssue = (issue: Issue) => {
    const nodeId = issue.node ?? (issue.edge ? issue.edge.split(".")[0] : null);
    if (issue.role && !issue.node) {
      showTab("roles");
      return;
    }
    if (!nodeId) return;
    const node = doc.nodes.find((n) => n.id === nodeId);
    if (!node) return;
    select(nodeId);
    flow.setCenter(node.position.x + 110, node.position.y + 50, { zoom: Math.max(flow.getZoom(), 1), duration: 300 });
  };

  return (
    <div className="editor" data-testid="editor">
      <header className="editor-bar">
        <div className="editor-title">
          <Link to="/workflows" className="icon-btn" aria-label="Back to workflows">
            <Icon name="chevron" style={{ transform: "rotate(180deg)" }} />
          </Link>
          <div className="editor-title-text">
            <div className="editor-name" data-testid="editor-name" title={workflow.name}>
              {workflow.name}
            </div>
            <div className="editor-sub">
              {base ? <span className="pill">v{base}</span> : <span className="pill pill-muted">unsaved</span>}
              {dirty && (
                <span className="dirty" data-testid="dirty">
                  ● unsaved changes
                </span>
              )}
            </div>
          </div>
        </div>
        <div className="editor-tools">
          <Button small variant="ghost" icon="undo" onClick={history.undo} disabled={!history.canUndo} title="Undo (Ctrl+Z)" aria-label="Undo" />
          <Button small variant="ghost" icon="redo" onClick={history.redo} disabled={!history.canRedo} title="Redo (Ctrl+Shift+Z)" aria-label="Redo" />
          <span className="divider" />
          <Button small variant="ghost" icon="layout" onClick={layout} disabled={doc.nodes.length === 0} title="Auto-layout" aria-label="Auto-layout">
            Auto-layout
          </Button>
          <Button small variant="ghost" icon="history" onClick={() => setShowHistory(true)} disabled={base === null} title="Version history" aria-label="History">
            History
          </Button>
          <div className="menu-wrap">
            <Button small variant="ghost" icon="download" onClick={() => setExportOpen((o) => !o)} disabled={base === null} title="Export" aria-label="Export" data-testid="export-menu">
              Export
            </Button>
            {exportOpen && base !== null && (
              <div className="menu" onMouseLeave={() => setExportOpen(false)}>
                <a href={workflows.exportUrl(workflow.id, "json", base)} download onClick={() => setExportOpen(false)} data-testid="export-json">
                  GraphSpec JSON (v{base})
                </a>
                <a href={workflows.exportUrl(workflow.id, "python", base)} download onClick={() => setExportOpen(false)} data-testid="export-python">
                  Python DSL (v{base})
                </a>
                <button
                  type="button"
                  data-testid="view-python"
                  onClick={async () => {
                    setExportOpen(false);
                    try {
                      setShowPython(String(await workflows.exportText(workflow.id, "python", base)));
                    } catch (err) {
                      toast(describeError(err), "error");
                    }
                  }}
                >
                  View as Python…
                </button>
              </div>
            )}
          </div>
        </div>
        <div className="editor-actions">
          <button
            type="button"
            className={`validity ${!checked ? "checking" : issueCount ? "bad" : "good"}`}
            onClick={() => showTab("issues")}
            data-testid="validity"
            data-checking={validating}
            title={validating ? "Checking the latest edit…" : "Validation by the studio"}
          >
            {!checked ? (
              <>
                <span className="spinner small" /> Checking
              </>
            ) : issueCount ? (
              <>
                <Icon name="alert" size={14} /> {issueCount} issue{issueCount === 1 ? "" : "s"}
              </>
            ) : (
              <>
                <Icon name="check" size={14} /> Valid
              </>
            )}
            {checked && validating && <span className="spinner small" />}
          </button>
          <Button small icon="save" onClick={() => setSaving(true)} data-testid="save">
            Save
          </Button>
          <Button small icon="rocket" onClick={() => setShowDeploy(true)} data-testid="deploy">
            Deploy
          </Button>
          <Button
            small
            variant="primary"
            icon="play"
            disabled={gate.disabled}
            title={gate.title}
            onClick={() => {
              if (gate.confirm && !window.confirm(gate.confirm)) return;
              navigate(`/workflows/${workflow.id}/run`);
            }}
            data-testid="run"
          >
            Run
          </Button>
        </div>
      </header>

      <div className="editor-body">
        <Palette kinds={kinds} onAdd={(k) => add(k)} open={paletteOpen} onToggle={() => setPaletteOpen((o) => !o)} />
        <div
          ref={canvasRef}
          className="canvas"
          onDragOver={(e) => {
            e.preventDefault();
            e.dataTransfer.dropEffect = "move";
          }}
          onDrop={onDrop}
          data-testid="canvas"
        >
          <ReactFlow<SpecNode, SpecEdge>
            nodes={view.nodes}
            edges={view.edges}
            nodeTypes={nodeTypes}
            onNodesChange={onNodesChange}
            onEdgesChange={onEdgesChange}
            onConnect={onConnect}
            onConnectEnd={onConnectEnd}
            isValidConnection={isValidConnection}
            onNodeClick={() => showTab("inspect")}
            onEdgeClick={() => showTab("inspect")}
            onNodeDragStart={onNodeDragStart}
            onNodeDragStop={onNodeDragStop}
            deleteKeyCode={["Backspace", "Delete"]}
            // Fitted by `useReadableFit` once measured (an empty canvas is not: that would fit the
            // first dropped node instead, moving the view under the user).
            defaultViewport={savedView}
            minZoom={0.2}
            maxZoom={2}
            proOptions={{ hideAttribution: true }}
            connectionRadius={28}
          >
            <Background variant={BackgroundVariant.Dots} gap={18} size={1.2} color="#cfd5de" />
            <FlowControls onFit={() => fit(300)} />
            {doc.nodes.length > 0 && <FlowMiniMap nodeColor={(n) => (n.data.issues?.length ? "#fca5a5" : "#c7d2fe")} />}
            {hint && (
              <Panel position="top-center">
                <div className="connect-hint" role="alert" data-testid="connect-hint">
                  <Icon name="alert" size={14} />
                  <span>{hint}</span>
                  <button type="button" className="icon-btn" aria-label="Dismiss" onClick={() => setHint(null)}>
                    <Icon name="x" size={12} />
                  </button>
                </div>
              </Panel>
            )}
          </ReactFlow>
          {doc.nodes.length === 0 && (
            <div className="canvas-empty">
              <Icon name="flow" size={28} />
              <strong>Drag a node kind from the palette</strong>
              <span className="muted">Start with an input, a function and an output; connect output ports (right) to input ports (left).</span>
            </div>
          )}
        </div>
        {!panelOpen && (
          <aside className="panel-rail panel-rail-right" aria-label="Side panel (folded)">
            <button
              type="button"
              className="icon-btn"
              title="Show the side panel"
              aria-label="Show the side panel"
              onClick={() => setPanelOpen(true)}
              data-testid="sidepanel-toggle"
            >
              <Icon name="panel" />
            </button>
            {issueCount > 0 && (
              <button type="button" className="rail-badge bad" onClick={() => showTab("issues")} title="Show the issues">
                {issueCount}
              </button>
            )}
          </aside>
        )}
        <aside className="sidepanel" hidden={!panelOpen} data-testid="sidepanel">
          <button
            type="button"
            className="panel-fold"
            title="Fold the side panel (more room for the graph)"
            aria-label="Fold the side panel"
            onClick={() => setPanelOpen(false)}
            data-testid="sidepanel-fold"
          >
            <Icon name="chevron" size={12} />
          </button>
          <div className="tabs" role="tablist">
            {(
              [
                ["inspect", selectedEdge ? "Edge" : "Node"],
                ["roles", `Roles (${doc.roles.length})`],
                ["workflow", "Workflow"],
                ["issues", `Issues${issueCount ? ` (${issueCount})` : ""}`],
              ] as [Tab, string][]
            ).map(([t, label]) => (
              <button
                key={t}
                type="button"
                role="tab"
                aria-selected={tab === t}
                className={`tab${tab === t ? " active" : ""}${t === "issues" && issueCount ? " tab-bad" : ""}`}
                onClick={() => setTab(t)}
                data-testid={`tab-${t}`}
              >
                {label}
              </button>
            ))}
          </div>
          <div className="sidepanel-body">
            {tab === "inspect" && selectedNode && (
              <NodeInspector
                key={selectedNode.id}
                doc={{ ...doc, nodes: view.nodes }}
                spec={selectedNode.data.spec}
                kind={catalogueMap.get(selectedNode.data.spec.kind)}
                ops={ops}
                edits={nodeEdits}
              />
            )}
            {tab === "inspect" && selectedEdge && (
              <EdgeInspector
                doc={doc}
                edge={view.edges.find((e) => e.id === selectedEdge.id) ?? selectedEdge}
                onStream={(s) => history.commit((d) => setEdgeStream(d, selectedEdge.id, s))}
                onRemove={() => history.commit((d) => removeElements(d, [], [selectedEdge.id]))}
              />
            )}
            {tab === "inspect" && !selectedNode && !selectedEdge && (
              <div className="panel-empty">
                <Icon name="flow" size={20} />
                <p>Select a node or an edge to edit its properties.</p>
                {selectedNodes.length + selectedEdges.length > 1 && (
                  <p className="muted small">{selectedNodes.length + selectedEdges.length} elements selected.</p>
                )}
              </div>
            )}
            {tab === "roles" && (
              <RolesPanel
                doc={doc}
                roleKinds={roleKinds}
                models={models}
                placed={placed}
                onAdd={(kind) => history.commit((d) => addRole(d, kind).doc)}
                onChange={(name, role: RoleSpec) => {
                  try {
                    history.commit((d) => updateRole(d, name, role));
                    return null;
                  } catch (err) {
                    toast((err as Error).message, "error");
                    return (err as Error).message;
                  }
                }}
                onRemove={(name) => history.commit((d) => removeRole(d, name))}
              />
            )}
            {tab === "workflow" && <WorkflowPanel doc={doc} onChange={(patch) => history.commit((d) => ({ ...d, ...patch }))} />}
            {tab === "issues" && (
              <div className="inspector" data-testid="issues-panel">
                <div className="inspector-head">
                  <div>
                    <div className="eyebrow">validation</div>
                    <h3>{issueCount ? `${issueCount} issue${issueCount === 1 ? "" : "s"}` : "No issues"}</h3>
                  </div>
                </div>
                {validationError && <ErrorBox>Could not validate: {validationError}</ErrorBox>}
                {issueCount === 0 && !validationError && (
                  <p className="muted small">
                    The workflow passes every check the studio makes.{" "}
                    {dirty ? "Save it to run or deploy these edits." : "Run it, or deploy it."}
                  </p>
                )}
                <IssueList issues={issues} onPick={focusIssue} />
              </div>
            )}
          </div>
        </aside>
      </div>

      {saving && (
        <SaveDialog
          workflowId={workflow.id}
          spec={spec}
          layout={docLayout(doc, flow.getViewport())}
          base={base}
          issueCount={issueCount}
          onClose={() => setSaving(false)}
          onSaved={(v, created) => {
            setSaving(false);
            onSaved(v, created);
          }}
        />
      )}
      {showHistory && (
        <VersionHistory workflowId={workflow.id} current={base} onClose={() => setShowHistory(false)} onOpen={openVersion} />
      )}
      {showDeploy && (
        <DeployDialog
          workflowId={workflow.id}
          workflowName={workflow.name}
          version={base}
          chat={baseChat}
          roles={doc.roles}
          dirty={dirty}
          onClose={() => setShowDeploy(false)}
        />
      )}
      {showPython !== null && (
        <Modal title={`${workflow.name} v${base} as Python`} onClose={() => setShowPython(null)} wide testId="python-dialog">
          <pre className="code-block" data-testid="python-source">
            {showPython}
          </pre>
        </Modal>
      )}
    </div>
  );
}
