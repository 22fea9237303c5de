"""ComfyUI nodes of the pack (V3 schema; also exposed through NODE_CLASS_MAPPINGS)."""
from comfy_api.latest import ComfyExtension

from .benchmark_node import SageAttentionBenchmarkRDNA4
from .patch_node import PatchSageAttentionRDNA4

NODES = [PatchSageAttentionRDNA4, SageAttentionBenchmarkRDNA4]

NODE_CLASS_MAPPINGS = {n.GET_SCHEMA().node_id: n for n in NODES}
NODE_DISPLAY_NAME_MAPPINGS = {n.GET_SCHEMA().node_id: n.GET_SCHEMA().display_name for n in NODES}


class SageRDNA4Extension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)


async def comfy_entrypoint() -> SageRDNA4Extension:
    return SageRDNA4Extension()
