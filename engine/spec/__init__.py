"""The light contract shared by the Control Flow and Compute Flow layers.

GraphSpec document types, the node-kind catalogue and the node-call convention live
here so that `engine.flow` (which validates and schedules) and `engine.compute`
(which runs) agree on them without importing each other.
"""
