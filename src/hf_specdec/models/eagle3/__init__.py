from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3DraftState, Eagle3ForDrafting, Eagle3Output

__all__ = ["Eagle3Config", "Eagle3ForDrafting", "Eagle3DraftState", "Eagle3Output"]
