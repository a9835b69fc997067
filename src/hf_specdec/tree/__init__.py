"""Trees: structure arithmetic, 4-D tree masks and policies (static presets as data, EAGLE-2 dynamic trees)."""

from .policies import (
    STATIC_TREES,
    TREE_OPTIONS,
    DynamicTree,
    StaticTree,
    TreeExpansion,
    TreePolicy,
    make_tree_policy,
    register_static_tree,
    register_tree_policy,
    static_tree_from_accuracies,
)
from .structure import (
    ancestor_matrix,
    as_batched_parents,
    children_table,
    node_depths,
    path_nodes,
    tree_structure,
    validate_parents,
)

__all__ = [
    "STATIC_TREES",
    "TREE_OPTIONS",
    "DynamicTree",
    "StaticTree",
    "TreeExpansion",
    "TreePolicy",
    "make_tree_policy",
    "register_tree_policy",
    "register_static_tree",
    "static_tree_from_accuracies",
    "ancestor_matrix",
    "as_batched_parents",
    "children_table",
    "node_depths",
    "path_nodes",
    "validate_parents",
    "tree_structure",
]
