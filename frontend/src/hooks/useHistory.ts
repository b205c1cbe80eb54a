/**
 * Undo/redo over immutable snapshots. `commit` records the present before changing it;
 * `replace` changes it without a record (selection, measured sizes, a drag in progress);
 * `record` pushes a given earlier snapshot (the state before a drag that moved nodes).
 */
import { useCallback, useMemo, useState } from "react";

const LIMIT = 200;

interface State<T> {
  past: T[];
  present: T;
  future: T[];
}

export interface History<T> {
  present: T;
  canUndo: boolean;
  canRedo: boolean;
  commit: (next: T | ((present: T) => T)) => void;
  replace: (next: T | ((present: T) => T)) => void;
  record: (before: T) => void;
  undo: () => void;
  redo: () => void;
  reset: (doc: T) => void;
}

export function useHistory<T>(initial: T): History<T> {
  const [state, setState] = useState<State<T>>({ past: [], present: initial, future: [] });

  const commit = useCallback((next: T | ((present: T) => T)) => {
    setState((s) => {
      const value = typeof next === "function" ? (next as (p: T) => T)(s.present) : next;
      if (value === s.present) return s;
      return { past: [...s.past.slice(-LIMIT + 1), s.present], present: value, future: [] };
    });
  }, []);
  const replace = useCallback((next: T | ((present: T) => T)) => {
    setState((s) => {
      const value = typeof next === "function" ? (next as (p: T) => T)(s.present) : next;
      return value === s.present ? s : { ...s, present: value };
    });
  }, []);
  const record = useCallback((before: T) => {
    setState((s) => ({ past: [...s.past.slice(-LIMIT + 1), before], present: s.present, future: [] }));
  }, []);
  const undo = useCallback(() => {
    setState((s) =>
      s.past.length === 0
        ? s
        : { past: s.past.slice(0, -1), present: s.past[s.past.length - 1], future: [s.present, ...s.future] },
    );
  }, []);
  const redo = useCallback(() => {
    setState((s) =>
      s.future.length === 0 ? s : { past: [...s.past, s.present], present: s.future[0], future: s.future.slice(1) },
    );
  }, []);
  const reset = useCallback((doc: T) => setState({ past: [], present: doc, future: [] }), []);

  return useMemo(
    () => ({
      present: state.present,
      canUndo: state.past.length > 0,
      canRedo: state.future.length > 0,
      commit,
      replace,
      record,
      undo,
      redo,
      reset,
    }),
    [state, commit, replace, record, undo, redo, reset],
  );
}
