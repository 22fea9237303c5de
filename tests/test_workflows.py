"""The example workflows: they parse, use only core ComfyUI node types or this pack's, and their links agree;
no two nodes overlap, each node is tall enough for its sockets and widgets, and each has its template picture.

Without ComfyUI the core types are checked against the list below; with COMFYUI_PATH set, that list, the
pack's node ids, and every node's sockets and widget count are checked against the real node definitions.
The same layouts in the real frontend (sizes as LiteGraph computes them): tests/test_web_extension.py.
"""
import asyncio
import json
import sys
from pathlib import Path

import pytest

import comfy_browser as browser  # node boxes and overlaps (its browser parts are not used here)

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / "example_workflows").glob("*.json"))


# Core ComfyUI node types the workflows may use (verified against ComfyUI itself when COMFYUI_PATH is set).
CORE_NODE_TYPES = {
    "CheckpointLoaderSimple", "CLIPLoader", "CLIPTextEncode", "ConditioningZeroOut", "CreateVideo",
    "DualCLIPLoader", "EmptyHunyuanLatentVideo", "EmptyLatentImage", "EmptySD3LatentImage", "FluxGuidance",
    "KSampler", "ModelSamplingSD3", "PreviewAny", "PreviewImage", "SaveImage", "SaveVideo", "UNETLoader",
    "VAEDecode", "VAELoader",
}
PACK_NODE_TYPES = {"PatchSageAttentionRDNA4", "SageAttentionBenchmarkRDNA4"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
ANY = "*"


def load(path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_promised_workflows_exist():
    names = {p.name for p in WORKFLOWS}
    assert {"Flux Sage text to image.json", "Wan Sage text to video.json", "SDXL Sage text to image.json",
            "Flux Sage benchmark.json"} <= names
    for path in WORKFLOWS:
        types = {n["type"] for n in load(path)["nodes"]}
        assert "PatchSageAttentionRDNA4" in types, f"{path.name} does not use the Patch node"
    assert "SageAttentionBenchmarkRDNA4" in {n["type"] for n in load(ROOT / "example_workflows" /
                                                                       "Flux Sage benchmark.json")["nodes"]}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_uses_known_node_types(path):
    unknown = {n["type"] for n in load(path)["nodes"]} - CORE_NODE_TYPES - PACK_NODE_TYPES
    assert not unknown, f"{path.name} uses node types that are neither core ComfyUI nor this pack: {unknown}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_links_are_consistent(path):
    wf = load(path)
    nodes = {n["id"]: n for n in wf["nodes"]}
    assert len(nodes) == len(wf["nodes"]), "duplicate node ids"
    assert wf["last_node_id"] >= max(nodes)
    link_ids = [link[0] for link in wf["links"]]
    assert len(set(link_ids)) == len(link_ids), "duplicate link ids"
    assert wf["last_link_id"] >= max(link_ids)
    for link_id, src, src_slot, dst, dst_slot, typ in wf["links"]:
        assert src in nodes and dst in nodes, f"link {link_id} joins a missing node"
        out = nodes[src]["outputs"][src_slot]
        inp = nodes[dst]["inputs"][dst_slot]
        assert link_id in (out["links"] or []), f"link {link_id} is not listed on its source output"
        assert inp["link"] == link_id, f"link {link_id} is not the link of its target input"
        assert out["type"] == typ and inp["type"] in (typ, ANY), f"link {link_id}: {out['type']} -> {inp['type']}"
    by_id = set(link_ids)
    for node in wf["nodes"]:
        for inp in node.get("inputs", []):
            assert inp["link"] is None or inp["link"] in by_id, f"node {node['id']} input {inp['name']}: dangling"
        for out in node.get("outputs", []):
            assert all(lid in by_id for lid in out["links"] or []), f"node {node['id']} output {out['name']}"


# -- layout: what the frontend draws -----------------------------------------------------------------------
# LiteGraph's layout constants (frontend 1.27): a socket row and a widget are 20 px, widgets 4 px apart plus
# 8 px below them, 6 px margin; a node's title bar (30 px) sits above pos[1].
SLOT_H, WIDGET_H, WIDGET_GAP, WIDGETS_PAD, MARGIN = 20, 20, 4, 8, 6


def min_height(node):
    """A lower bound of LiteGraph's computeSize height: socket rows, then one row per widget value.

    Multiline text boxes are taller than a row, so the real minimum can be higher: the browser test compares
    every size with the frontend's own computeSize."""
    rows = max(1, len(node.get("inputs", [])), len(node.get("outputs", [])))
    widgets = len(node.get("widgets_values") or [])
    return rows * SLOT_H + (widgets * (WIDGET_H + WIDGET_GAP) + WIDGETS_PAD if widgets else 0) + MARGIN


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_no_two_nodes_overlap(path):
    nodes = load(path)["nodes"]
    clashes = browser.overlaps(nodes)
    names = {n["id"]: n.get("title") or n["type"] for n in nodes}
    assert not clashes, f"{path.name}: overlapping nodes (title bars included): " + ", ".join(
        f"{names[a]} / {names[b]}" for a, b in clashes)


def test_the_overlap_check_sees_title_bars():
    body = {"id": 1, "pos": [0, 0], "size": [100, 100]}
    assert browser.overlaps([body, {"id": 2, "pos": [0, 120], "size": [100, 50]}]) == [(1, 2)]  # title at 90..120
    assert browser.overlaps([body, {"id": 2, "pos": [0, 131], "size": [100, 50]}]) == []
    assert browser.overlaps([body, {"id": 2, "pos": [100, 0], "size": [10, 10]}]) == []  # edges may touch


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_nodes_are_tall_enough_for_their_widgets(path):
    for node in load(path)["nodes"]:
        assert node["size"][1] >= min_height(node), \
            f"{path.name} node {node['id']} ({node['type']}): {node['size'][1]} px < {min_height(node)} px"


def test_the_patch_node_shows_all_its_widgets():
    wf = load(ROOT / "example_workflows" / "Flux Sage text to image.json")
    patch = next(n for n in wf["nodes"] if n["type"] == "PatchSageAttentionRDNA4")
    assert min_height(patch) == 298  # what the frontend's computeSize gives (1 socket row, 11 widgets)


# The longest card title the frontend's template browser shows unclipped ("wan_text_to_video_sage_rdn..." was cut
# at 26 characters).
CARD_TITLE_CHARS = 24


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_template_file_name_reads_as_its_card_title(path):
    """Frontend 1.27 shows a custom node's template by its file name, as title and (with '-' and '_' made spaces)
    as description; it ignores `extra.template`. So the name itself is the title: words, short enough to show."""
    name = path.stem
    assert "_" not in name and "-" not in name and name.strip() == name and "  " not in name, name
    assert 8 <= len(name) <= CARD_TITLE_CHARS, name
    assert "Sage" in name and name[0].isupper(), name


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_template_has_a_readable_title_and_a_one_line_description(path):
    """For a frontend or an index that reads them: a title and description in `extra.template`, in the fields of
    a core template entry (templates/index.json: title, description)."""
    meta = load(path)["extra"].get("template")
    assert isinstance(meta, dict), f"{path.name}: no extra.template"
    title, description = meta.get("title"), meta.get("description")
    assert isinstance(title, str) and title.strip() == title and 8 <= len(title) <= 40, f"{path.name}: {title!r}"
    assert "_" not in title and not title.endswith(".json")  # words, not a file name
    assert isinstance(description, str) and description.strip() == description, f"{path.name}: {description!r}"
    assert "\n" not in description and 20 <= len(description) <= 160, f"{path.name}: {description!r}"
    assert description.endswith(".") and description != title
    assert "SDPA" not in title + description  # the A/B baseline is the model's own attention


# The model files the workflows load, and where ComfyUI's own templates (comfyui-workflow-templates) download them.
OFFICIAL_HOSTS = ("https://huggingface.co/Comfy-Org/", "https://huggingface.co/comfyanonymous/",
                  "https://huggingface.co/stabilityai/")
MODEL_FOLDERS = {"UNETLoader": "diffusion_models", "CheckpointLoaderSimple": "checkpoints", "VAELoader": "vae",
                 "CLIPLoader": "text_encoders", "DualCLIPLoader": "text_encoders"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_every_model_file_has_its_download_for_the_missing_models_dialog(path):
    """The frontend's Missing Models dialog reads `properties.models` of each node: name, url, directory (the
    format of the core templates). Each file a loader names must be listed there, from an official repository,
    in the folder the loader reads."""
    loaders = [n for n in load(path)["nodes"] if n["type"] in MODEL_FOLDERS]
    assert loaders, f"{path.name} loads no model"
    for node in loaders:
        files = [v for v in node["widgets_values"] if isinstance(v, str) and v.endswith(".safetensors")]
        models = node["properties"].get("models")
        assert isinstance(models, list) and [m["name"] for m in models] == files, (path.name, node["id"], models)
        for m in models:
            assert set(m) == {"name", "url", "directory"}, m
            assert m["url"].startswith(OFFICIAL_HOSTS) and "/resolve/main/" in m["url"], m
            assert m["url"].split("?")[0].endswith("/" + m["name"]), m
            assert m["directory"] == MODEL_FOLDERS[node["type"]], m


def test_template_titles_are_distinct():
    titles = [load(p)["extra"]["template"]["title"] for p in WORKFLOWS]
    assert len(set(titles)) == len(titles) == len(WORKFLOWS)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_template_thumbnail(path):
    """ComfyUI's template browser shows example_workflows/<name>.jpg on the workflow's card."""
    from PIL import Image, ImageStat

    jpg = path.with_suffix(".jpg")
    assert jpg.is_file(), f"no thumbnail {jpg.name} (make it: tools/template_thumbnails.py)"
    assert jpg.stat().st_size < 150 * 1024
    with Image.open(jpg) as im:
        assert im.format == "JPEG"
        assert 256 <= im.width <= 1600 and 128 <= im.height <= 1200
        assert max(ImageStat.Stat(im.convert("L")).stddev) > 10, "a blank picture"


# -- against the real ComfyUI ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def comfy_nodes(tmp_path_factory):
    import comfy_harness as harness

    harness.comfy_import(cpu=True)
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    link = tmp_path_factory.mktemp("custom_nodes") / "ComfyUI-Sage-RDNA4"
    link.symlink_to(ROOT, target_is_directory=True)
    assert asyncio.run(nodes.load_custom_node(str(link)))
    module = sys.modules[str(link).replace(".", "_x_")]  # the name load_custom_node gives a folder module
    pack = set(module.NODE_CLASS_MAPPINGS)
    core = set(nodes.NODE_CLASS_MAPPINGS) - pack
    return nodes, core, pack


@pytest.mark.comfyui
def test_committed_lists_match_comfyui(comfy_nodes):
    _, core, pack = comfy_nodes
    assert CORE_NODE_TYPES <= core, f"not core ComfyUI node types: {CORE_NODE_TYPES - core}"
    assert pack == PACK_NODE_TYPES


def _definition(cls):
    """(socket inputs {name: type}, number of widget values, output types) as the frontend builds them."""
    sockets, widgets = {}, 0
    for section in ("required", "optional"):
        for name, entry in cls.INPUT_TYPES().get(section, {}).items():
            typ = entry[0] if isinstance(entry[0], str) else "COMBO"
            typ = str(getattr(typ, "value", typ))
            opts = entry[1] if len(entry) > 1 else {}
            if typ in WIDGET_TYPES and not opts.get("forceInput"):
                widgets += 2 if opts.get("control_after_generate") else 1
            else:
                sockets[name] = typ
    return sockets, widgets, [str(getattr(t, "value", t)) for t in cls.RETURN_TYPES]


@pytest.mark.comfyui
@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_nodes_match_their_definitions(comfy_nodes, path):
    nodes = comfy_nodes[0]
    for node in load(path)["nodes"]:
        sockets, widgets, outputs = _definition(nodes.NODE_CLASS_MAPPINGS[node["type"]])
        where = f"{path.name} node {node['id']} ({node['type']})"
        for inp in node["inputs"]:
            assert inp["name"] in sockets, f"{where}: no input {inp['name']}"
            assert inp["type"] == sockets[inp["name"]], f"{where}: input {inp['name']} type"
        assert len(node["widgets_values"]) == widgets, f"{where}: widget values"
        assert [o["type"] for o in node["outputs"]] == outputs, f"{where}: outputs"
