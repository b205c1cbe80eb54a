/** How the version diff marks what it lists: added, removed or changed, each with its sign and chip. */
import type { FieldChange, VersionDiff } from "../api/types";

export type Change = FieldChange["change"];

export const CHANGE_MARK: Record<Change, { sign: string; chip: string }> = {
  added: { sign: "+", chip: "chip-added" },
  removed: { sign: "−", chip: "chip-removed" },
  changed: { sign: "~", chip: "chip-changed" },
};

/** The workflow's own fields (name, description, ...) that differ, in the server's order, each
 * with what happened to it: against nothing (a first version) every field is added. */
export function workflowFieldChanges(diff: VersionDiff): { name: string; change: Change }[] {
  return Object.entries(diff.fields).map(([name, field]) => ({ name, change: field.change }));
}
