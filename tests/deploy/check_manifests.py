#!/usr/bin/env python3
"""Renders the kustomize base, the examples and the Helm chart (several value sets), validates
every object against the Kubernetes JSON schemas bundled in `kubernetes-validate` (offline),
and checks what schemas cannot: references between objects, the driver name agreeing
everywhere, the handover update strategies, $(VAR) expansions, and that every flag given to our
binary is a flag the binary accepts.

Run by tests/deploy_manifests.rs. Needs: kubectl (kustomize is built in), and
`pip install kubernetes-validate helm-python-sdk` (the latter bundles Helm's Go SDK as a shared
library, so charts render without a helm binary or a cluster).

Exit status 0 = all good; otherwise every problem is printed, one per line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
from typing import Any

import yaml

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BASE = os.path.join(REPO, "deploy", "kubernetes", "base")
EXAMPLES = os.path.join(REPO, "deploy", "kubernetes", "examples")
CHART = os.path.join(REPO, "deploy", "helm", "seaweedfs-csi-driver")
# Oldest Kubernetes the chart claims (Chart.yaml kubeVersion) and the newest schemas bundled.
K8S_VERSIONS = ["1.26.0", "latest"]
OUR_IMAGE = re.compile(r"(^|/)seaweedfs-csi-driver(:|@|$)")
# StorageClass / volume-context keys the driver reads (docs/CONFIGURATION.md).
KNOWN_SC_PARAMS = {
    "collection", "replication", "diskType", "disk", "ttl", "chunkSizeLimitMB",
    "volumeServerAccess", "readRetryTime", "dataCenter", "dataLocality", "uidMap", "map.uid",
    "gidMap", "map.gid", "cacheCapacityMB", "cacheMetaTtlSec", "concurrentReaders",
    "concurrentWriters", "filer", "filer.path", "path", "parentDir", "volumeName",
    "volumeCapacity",
}

Doc = dict[str, Any]


class Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, msg: str) -> None:
        self.items.append(f"{where}: {msg}")


def load_docs(text: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all(text) if d]


def render_kustomize(path: str) -> list[Doc]:
    out = subprocess.run(
        ["kubectl", "kustomize", path], check=True, capture_output=True, text=True, timeout=120
    )
    return load_docs(out.stdout)


LAST_NOTES = ""


def render_helm(values: dict[str, Any], namespace: str = "csi", chart_dir: str = CHART,
                release: str = "swfs", is_upgrade: bool = False) -> list[Doc]:
    import helm_python as helm

    with helm.Chart.load(chart_dir) as chart:
        out = chart.render(values, name=release, namespace=namespace,
                           is_install=not is_upgrade, is_upgrade=is_upgrade)
    global LAST_NOTES
    LAST_NOTES = next((out[n] for n in out if n.endswith("NOTES.txt")), "")
    docs: list[Doc] = []
    for name in sorted(out):
        if name.endswith(".yaml"):
            docs.extend(load_docs(out[name]))
    return docs


def helm_lint_errors() -> list[str]:
    import helm_python as helm

    res = helm.lint(CHART, {"seaweedfsFiler": "filer:8888"}, strict=True)
    return [f"{m.get('path')}: {m.get('error')}" for m in res.get("messages", [])
            if m.get("severity", 0) >= 2] + [str(e) for e in res.get("errors", [])]


def schema_validate(where: str, docs: list[Doc], p: Problems) -> None:
    import kubernetes_validate

    for version in K8S_VERSIONS:
        v = kubernetes_validate.latest_version() if version == "latest" else version
        for d in docs:
            ident = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
            if d.get("apiVersion", "").startswith("monitoring.coreos.com/"):
                continue  # a CRD's kind: no bundled schema; check_monitoring checks it
            try:
                kubernetes_validate.validate(d, v, strict=True)
            except kubernetes_validate.ValidationError as e:
                p.add(where, f"{ident} invalid for Kubernetes {v}: {e.message} at {list(e.path)}")
            except Exception as e:  # schema missing for the kind, etc.
                p.add(where, f"{ident}: cannot validate for Kubernetes {v}: {e}")


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d.get("kind") == kind]


def name_of(d: Doc) -> str:
    return d.get("metadata", {}).get("name", "")


def pod_spec(d: Doc) -> Doc | None:
    if d.get("kind") in ("Deployment", "DaemonSet", "StatefulSet"):
        return d["spec"]["template"]["spec"]
    if d.get("kind") == "Pod":
        return d["spec"]
    return None


def flag_names(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_workloads(where: str, docs: list[Doc], p: Problems, flags: dict[str, set[str]] | None,
                    external: set[str]) -> None:
    sas = {name_of(d) for d in by_kind(docs, "ServiceAccount")}
    cms = {name_of(d) for d in by_kind(docs, "ConfigMap")} | external
    secrets = {name_of(d) for d in by_kind(docs, "Secret")} | external
    for d in docs:
        spec = pod_spec(d)
        if spec is None:
            continue
        ident = f"{where} {d['kind']}/{name_of(d)}"
        if d["kind"] != "Pod":
            sel = d["spec"]["selector"].get("matchLabels", {})
            labels = d["spec"]["template"]["metadata"].get("labels", {})
            for k, v in sel.items():
                if labels.get(k) != v:
                    p.add(ident, f"selector {k}={v} does not match the pod template labels")
            sa = spec.get("serviceAccountName")
            if sa and sa not in sas:
                p.add(ident, f"serviceAccountName {sa} is not defined")
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        used: set[str] = set()
        seen_ports: set[int] = set()
        names: set[str] = set()
        for c in spec.get("containers", []):
            cid = f"{ident} container {c['name']}"
            if c["name"] in names:
                p.add(cid, "duplicate container name")
            names.add(c["name"])
            for m in c.get("volumeMounts", []):
                used.add(m["name"])
                if m["name"] not in vols:
                    p.add(cid, f"volumeMount {m['name']} has no volume")
                if m.get("mountPropagation") == "Bidirectional" and not (
                    c.get("securityContext", {}).get("privileged")
                ):
                    p.add(cid, "Bidirectional propagation needs a privileged container")
            env_names = {e["name"] for e in c.get("env", [])}
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref and ref["configMapKeyRef"]["name"] not in cms:
                    p.add(cid, f"env {e['name']} uses missing ConfigMap")
                if "secretKeyRef" in ref and ref["secretKeyRef"]["name"] not in secrets:
                    p.add(cid, f"env {e['name']} uses missing Secret")
            for a in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                    if var not in env_names:
                        p.add(cid, f"arg {a!r} refers to $({var}), which is not in env")
            ports = {}
            for port in c.get("ports", []):
                if port["containerPort"] in seen_ports:
                    p.add(cid, f"port {port['containerPort']} used twice in the pod")
                seen_ports.add(port["containerPort"])
                if "name" in port:
                    ports[port["name"]] = port["containerPort"]
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    p.add(cid, f"{probe} uses port {port!r}, not a named port of this container")
                if isinstance(port, int) and port not in seen_ports and not any(
                    port == q.get("containerPort") for cc in spec["containers"]
                    for q in cc.get("ports", [])
                ):
                    # a probe may target a sidecar's port; it must exist somewhere in the pod
                    p.add(cid, f"{probe} port {port} is not exposed by any container")
            if OUR_IMAGE.search(c.get("image", "")) and flags is not None:
                args = c.get("args", [])
                known = flags["keeper"] if args[:1] == ["keeper"] else flags["driver"]
                for f in flag_names(args):
                    if f not in known:
                        p.add(cid, f"flag {f} is not accepted by the binary")
        for v in vols:
            if v not in used:
                p.add(ident, f"volume {v} is mounted by no container")
        for v in vols.values():
            if "configMap" in v and v["configMap"]["name"] not in cms:
                p.add(ident, f"volume {v['name']} uses missing ConfigMap")
            if "secret" in v and v["secret"]["secretName"] not in secrets:
                p.add(ident, f"volume {v['name']} uses missing Secret")


def check_rbac(where: str, docs: list[Doc], namespace: str, p: Problems) -> None:
    sas = {name_of(d) for d in by_kind(docs, "ServiceAccount")}
    roles = {("Role", name_of(d)) for d in by_kind(docs, "Role")}
    roles |= {("ClusterRole", name_of(d)) for d in by_kind(docs, "ClusterRole")}
    for b in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        ident = f"{where} {b['kind']}/{name_of(b)}"
        ref = b["roleRef"]
        if (ref["kind"], ref["name"]) not in roles:
            p.add(ident, f"roleRef {ref['kind']}/{ref['name']} is not defined")
        for s in b.get("subjects", []):
            if s["kind"] == "ServiceAccount":
                if s["name"] not in sas:
                    p.add(ident, f"subject ServiceAccount {s['name']} is not defined")
                if s.get("namespace") != namespace:
                    p.add(ident, f"subject namespace {s.get('namespace')} != {namespace}")


def container(d: Doc, name: str) -> Doc | None:
    for c in pod_spec(d)["containers"]:
        if c["name"] == name:
            return c
    return None


def arg_value(c: Doc, flag: str) -> str | None:
    for a in c.get("args", []):
        # An unquoted arg with YAML syntax in it renders as something else than a string.
        if isinstance(a, str) and a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def host_path(d: Doc, mount_path: str, c: Doc) -> str | None:
    vols = {v["name"]: v for v in pod_spec(d).get("volumes", [])}
    for m in c.get("volumeMounts", []):
        if m["mountPath"] == mount_path and "hostPath" in vols.get(m["name"], {}):
            return vols[m["name"]]["hostPath"]["path"]
    return None


KUBELET_DIRS = ("/var/lib/kubelet/plugins", "/var/lib/kubelet/pods")


def check_driver(where: str, docs: list[Doc], p: Problems, attacher: bool = False,
                 kubelet_dirs: tuple[str, ...] = KUBELET_DIRS, allow_taints: bool = False,
                 fs_group_policy: str = "None") -> None:
    """The CSI-specific shape: one driver name everywhere, handover-friendly node layout."""
    drivers = by_kind(docs, "CSIDriver")
    if len(drivers) != 1:
        p.add(where, f"expected one CSIDriver, found {len(drivers)}")
        return
    drv = drivers[0]
    name = name_of(drv)
    spec = drv["spec"]
    if spec.get("attachRequired") is not attacher:
        p.add(where, f"CSIDriver attachRequired should be {attacher}")
    if spec.get("podInfoOnMount") is not True:
        p.add(where, "CSIDriver podInfoOnMount should be true")
    if spec.get("fsGroupPolicy") != fs_group_policy:
        p.add(where, f"CSIDriver fsGroupPolicy should be {fs_group_policy}, is {spec.get('fsGroupPolicy')}")
    for sc in by_kind(docs, "StorageClass"):
        if sc["provisioner"] != name:
            p.add(where, f"StorageClass {name_of(sc)} provisioner {sc['provisioner']} != {name}")
        for k in sc.get("parameters", {}) or {}:
            if k not in KNOWN_SC_PARAMS:
                p.add(where, f"StorageClass {name_of(sc)} parameter {k} is not read by the driver")

    workloads = by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")
    comp = lambda d: d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
    ctrl = [d for d in workloads if comp(d) == "controller"]
    node = [d for d in workloads if comp(d) == "node"]
    keeper = [d for d in workloads if comp(d) == "keeper"]
    if len(ctrl) != 1 or len(node) != 1 or len(keeper) != 1:
        p.add(where, f"expected one controller, node and keeper workload: {len(ctrl)} {len(node)} {len(keeper)}")
        return
    ctrl, node, keeper = ctrl[0], node[0], keeper[0]

    # controller
    plugin = container(ctrl, "seaweedfs-csi-plugin")
    if plugin is None:
        p.add(where, "controller has no seaweedfs-csi-plugin container")
    else:
        if arg_value(plugin, "--driverName") != name:
            p.add(where, "controller --driverName differs from the CSIDriver name")
        if arg_value(plugin, "--components") != "controller":
            p.add(where, "controller must run --components=controller")
        if "livenessProbe" not in plugin:
            p.add(where, "controller plugin container has no livenessProbe")
        if arg_value(plugin, "--attacher") != str(attacher).lower():
            p.add(where, f"controller --attacher must be {str(attacher).lower()} to match attachRequired")
    images = " ".join(c["image"] for c in pod_spec(ctrl)["containers"])
    for sidecar in ("csi-provisioner", "csi-resizer", "livenessprobe"):
        if sidecar not in images:
            p.add(where, f"controller lacks the {sidecar} sidecar")
    if ("csi-attacher" in images) != attacher:
        p.add(where, f"controller csi-attacher presence should be {attacher}")

    # node plugin: handover strategy, mounts
    ns = node["spec"].get("updateStrategy", {})
    ru = ns.get("rollingUpdate", {})
    if ns.get("type") != "RollingUpdate" or ru.get("maxSurge") != 1 or ru.get("maxUnavailable") != 0:
        p.add(where, f"node DaemonSet must roll with maxSurge 1 / maxUnavailable 0, has {ns}")
    nspec = pod_spec(node)
    if nspec.get("hostNetwork"):
        p.add(where, "node DaemonSet must not use hostNetwork (surge pods would share ports)")
    plugin = container(node, "seaweedfs-csi-plugin")
    if plugin is None:
        p.add(where, "node has no seaweedfs-csi-plugin container")
        return
    if not plugin.get("securityContext", {}).get("privileged"):
        p.add(where, "node plugin must be privileged")
    if arg_value(plugin, "--driverName") != name:
        p.add(where, "node --driverName differs from the CSIDriver name")
    if arg_value(plugin, "--components") != "node":
        p.add(where, "node must run --components=node")
    props = {m["mountPath"]: m.get("mountPropagation") for m in plugin.get("volumeMounts", [])}
    nvols = {v["name"]: v for v in nspec.get("volumes", [])}
    for m in plugin.get("volumeMounts", []):
        if m.get("mountPropagation") != "Bidirectional":
            continue
        hp = nvols.get(m["name"], {}).get("hostPath", {}).get("path")
        # kubelet passes staging/target paths in host terms: the plugin must see them there.
        if hp != m["mountPath"]:
            p.add(where, f"node plugin mounts host {hp} at {m['mountPath']}: kubelet paths "
                         "must be mounted at the same path inside")
    for path in kubelet_dirs:
        if props.get(path) != "Bidirectional":
            p.add(where, f"node plugin needs {path} with Bidirectional propagation")
    for d in (node, keeper):
        if {"operator": "Exists"} not in (pod_spec(d).get("tolerations") or []) and not allow_taints:
            p.add(where, f"{name_of(d)} must tolerate every taint (operator: Exists)")
    if "/dev" not in props:
        p.add(where, "node plugin needs /dev")
    for probe in ("livenessProbe", "readinessProbe"):
        if probe not in plugin:
            p.add(where, f"node plugin has no {probe}")
    names = [c["name"] for c in nspec["containers"]]
    if any("registrar" in n for n in names):
        p.add(where, "node-driver-registrar must not run in the surging node pod")

    # keeper: OnDelete, same socket as the plugin, registrar pointing at the plugin socket
    if keeper["spec"].get("updateStrategy", {}).get("type") != "OnDelete":
        p.add(where, "keeper DaemonSet must use OnDelete")
    kc = container(keeper, "keeper")
    if kc is None:
        p.add(where, "keeper DaemonSet has no keeper container")
        return
    if kc.get("args", [])[:1] != ["keeper"]:
        p.add(where, "keeper container must run the keeper subcommand")
    sock = arg_value(kc, "--socket")
    if sock != arg_value(plugin, "--keeperSocket"):
        p.add(where, f"keeper socket {sock} != node --keeperSocket {arg_value(plugin, '--keeperSocket')}")
    if sock:
        sdir = os.path.dirname(sock)
        hk, hp = host_path(keeper, sdir, kc), host_path(node, sdir, plugin)
        if not hk or hk != hp:
            p.add(where, f"keeper socket dir {sdir} must be the same hostPath in both pods ({hk} vs {hp})")
    reg = [c for c in pod_spec(keeper)["containers"] if "node-driver-registrar" in c["image"]]
    if len(reg) != 1:
        p.add(where, "keeper pod must run exactly one node-driver-registrar")
        return
    reg = reg[0]
    env = {e["name"]: e.get("value") for e in reg.get("env", [])}
    kubelet_sock = env.get("DRIVER_REG_SOCK_PATH", "")
    if f"/{name}/" not in kubelet_sock:
        p.add(where, f"registration path {kubelet_sock} does not contain the driver name")
    endpoint = next((e.get("value") for e in plugin.get("env", []) if e["name"] == "CSI_ENDPOINT"), "")
    sock_in_plugin = endpoint.replace("unix://", "")
    plugin_host = host_path(node, os.path.dirname(sock_in_plugin), plugin)
    reg_host = host_path(keeper, os.path.dirname(env.get("ADDRESS", "")), reg)
    if not plugin_host or plugin_host != reg_host:
        p.add(where, f"registrar and plugin see different socket dirs ({reg_host} vs {plugin_host})")
    if plugin_host and os.path.join(plugin_host, os.path.basename(sock_in_plugin)) != kubelet_sock:
        p.add(where, f"kubelet registration path {kubelet_sock} is not where the plugin listens")


def check_set(where: str, docs: list[Doc], namespace: str, p: Problems,
              flags: dict[str, set[str]] | None, attacher: bool = False,
              external: set[str] = frozenset(), kubelet_dirs: tuple[str, ...] = KUBELET_DIRS,
              allow_taints: bool = False, fs_group_policy: str = "None") -> None:
    if not docs:
        p.add(where, "rendered nothing")
        return
    schema_validate(where, docs, p)
    check_workloads(where, docs, p, flags, set(external))
    check_rbac(where, docs, namespace, p)
    check_driver(where, docs, p, attacher, kubelet_dirs, allow_taints, fs_group_policy)


# Values in the style of the Go driver's chart, including keys this chart does not use
# (mountService.*, csiSnapshotter, injectTopologyInfoFromNodeLabel): they must not break it.
GO_STYLE_VALUES = {
    "seaweedfsFiler": "seaweedfs-filer.storage:8888",
    "storageClassName": "seaweedfs-storage",
    "storageClassParameters": {"volumeServerAccess": "filerProxy", "replication": "001"},
    "logVerbosity": 4,
    "cacheCapacityMB": 0,
    "concurrentWriters": 128,
    "imagePullSecrets": [{"name": "mycredentials"}],
    "csiSnapshotter": {"enabled": False},
    "mountService": {"enabled": True, "image": "chrislusf/seaweedfs-mount"},
    "node": {"hostPID": True, "injectTopologyInfoFromNodeLabel": {"enabled": False},
             "mountEndpoint": "", "mountSocketDir": "", "mountHostPath": "",
             "livenessProbe": {"failureThreshold": None, "initialDelaySeconds": 10,
                               "timeoutSeconds": 3, "periodSeconds": 60}},
    "controller": {"replicas": 1, "resources": {}, "affinity": {}},
    "dataLocality": "none",
}

FULL_VALUES = {
    "seaweedfsFiler": "f1:8888,f2:8888",
    "driverName": "swfs.example.com",
    "tlsSecret": "filer-client-tls",
    "security": {"enabled": True, "create": True, "type": "secret",
                 "content": "[jwt.signing.read]\nkey = \"k\"\n"},
    "csiAttacher": {"enabled": True},
    "isDefaultStorageClass": True,
    "storageClassParameters": {"collection": "c", "chunkSizeLimitMB": 8, "diskType": "ssd"},
    "cacheCapacityMB": 256, "cacheMetaTtlSec": 30, "concurrentWriters": 64,
    "concurrentReaders": 32,
    "dataLocality": "write_preferLocalDc",
    "logFilter": "info,seaweedfs_csi_driver=debug",
    "node": {"dataCenter": "dc1", "tolerations": [{"operator": "Exists"}], "memoryBudgetMB": 768,
             "nodeSelector": {"kubernetes.io/os": "linux"},
             "volumes": {"plugins_dir": "/var/lib/k0s/kubelet/plugins",
                         "pods_mount_dir": "/var/lib/k0s/kubelet/pods",
                         "registration_dir": "/var/lib/k0s/kubelet/plugins_registry"}},
    "controller": {"replicas": 2, "tolerations": [{"operator": "Exists"}]},
    "fsGroupPolicy": "File",
}


TOPOLOGY_VALUES = {
    "dataLocality": "write_preferLocalDc",
    "node": {"topologyKeys": ["topology.kubernetes.io/zone", "example.com/rack=r1"],
             "dataCenterLabel": "topology.kubernetes.io/zone"},
}


def topology_facts(docs: list[Doc]) -> dict[str, Any]:
    """What node.topologyKeys / node.dataCenterLabel change: node args, the provisioner's
    feature gate, the node ServiceAccount's token and RBAC rules."""
    node = next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d).endswith("-node"))
    plugin = container(node, "seaweedfs-csi-plugin")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    prov = container(dep, "csi-provisioner")
    controller = container(dep, "seaweedfs-csi-plugin")
    sa = pod_spec(node)["serviceAccountName"]
    bound = {b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")
             if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])}
    rules = [r for d in by_kind(docs, "ClusterRole") if name_of(d) in bound
             for r in d.get("rules", [])]
    return {
        "topologyKeys": arg_value(plugin, "--topologyKeys"),
        # The provisioner asks the controller's Identity whether to do topology.
        "controllerKeys": arg_value(controller, "--topologyKeys"),
        "dataCenterLabel": arg_value(plugin, "--dataCenterLabel"),
        "dataCenter": arg_value(plugin, "--dataCenter"),
        "featureGate": "--feature-gates=Topology=true" in prov["args"],
        "token": pod_spec(node).get("automountServiceAccountToken"),
        "nodeRules": rules,
    }


def check_topology(p: Problems, flags: dict[str, set[str]] | None) -> None:
    """Off by default; label keys give the node plugin a token and `get` on nodes only; any
    topology key turns the provisioner's Topology feature gate on."""
    docs = render_helm(copy.deepcopy(TOPOLOGY_VALUES))
    check_set("helm topology", docs, "csi", p, flags)
    got = topology_facts(docs)
    want = {"topologyKeys": "topology.kubernetes.io/zone,example.com/rack=r1",
            "controllerKeys": "topology.kubernetes.io/zone,example.com/rack=r1",
            "dataCenterLabel": "topology.kubernetes.io/zone", "dataCenter": None,
            "featureGate": True, "token": True,
            "nodeRules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]}
    if got != want:
        p.add("helm topology", f"got {got}, want {want}")
    off = {"topologyKeys": None, "controllerKeys": None, "dataCenterLabel": None,
           "dataCenter": None, "featureGate": False, "token": False, "nodeRules": []}
    cases = [
        ("helm defaults", {}, off),
        # Fixed segments only: no API access needed.
        ("helm topology key=value", {"node": {"topologyKeys": " zone=a , "}},
         {**off, "topologyKeys": "zone=a", "controllerKeys": "zone=a", "featureGate": True}),
        # The Go chart's KubeMod injection, read directly.
        ("helm go-style topology injection",
         {"node": {"injectTopologyInfoFromNodeLabel": {"enabled": True}}},
         {**off, "dataCenterLabel": "topology.kubernetes.io/zone", "token": True,
          "nodeRules": want["nodeRules"]}),
        ("helm go-style topology injection, own label",
         {"node": {"injectTopologyInfoFromNodeLabel": {
             "enabled": True, "labels": {"dataCenter": "example.com/dc"}}}},
         {**off, "dataCenterLabel": "example.com/dc", "token": True,
          "nodeRules": want["nodeRules"]}),
        # node.dataCenter wins: no label is read, so no flag, token or RBAC for it.
        ("helm dataCenter and dataCenterLabel",
         {"node": {"dataCenter": "dc1", "dataCenterLabel": "topology.kubernetes.io/zone"}},
         {**off, "dataCenter": "dc1"}),
        ("helm dataCenter and go-style injection",
         {"node": {"dataCenter": "dc1", "injectTopologyInfoFromNodeLabel": {"enabled": True}}},
         {**off, "dataCenter": "dc1"}),
        ("helm dataCenter with YAML syntax", {"node": {"dataCenter": "dc: 1 #x"}},
         {**off, "dataCenter": "dc: 1 #x"}),
        # YAML-significant characters reach the plugin as given (quoted), for it to judge.
        ("helm topologyKeys with YAML syntax", {"node": {"topologyKeys": "rack=r1: x #y"}},
         {**off, "topologyKeys": "rack=r1: x #y", "controllerKeys": "rack=r1: x #y",
          "featureGate": True}),
        # Blank entries render nothing.
        ("helm blank topologyKeys", {"node": {"topologyKeys": " , "}}, off),
        ("helm empty topologyKeys list", {"node": {"topologyKeys": []}}, off),
        # Helm drops a null that overrides a default before the schema sees it: the default.
        ("helm null dataCenterLabel", {"node": {"dataCenterLabel": None}}, off),
    ]
    for where, values, exp in cases:
        got = topology_facts(render_helm(copy.deepcopy(values)))
        if got != exp:
            p.add(where, f"topology: got {got}, want {exp}")
    inject = "injectTopologyInfoFromNodeLabel"
    for bad in [{"node": {"dataCenterLabel": "a=b"}}, {"node": {"dataCenterLabel": "  "}},
                {"node": {"dataCenterLabel": "a b"}},
                {"node": {"topologyKeys": ["a,b"]}}, {"node": {"topologyKeys": [" "]}},
                {"node": {"topologyKeys": [""]}}, {"node": {"topologyKeys": 3}},
                {"node": {inject: {"enabled": "yes"}}},
                {"node": {inject: {"enabled": True, "labels": {"dataCenter": "a=b"}}}},
                {"node": {inject: {"enabled": True, "labels": {"dataCenter": " "}}}},
                {"node": {inject: {"enabled": True, "labels": {"dataCenter": None}}}}]:
        try:
            render_helm(copy.deepcopy(bad))
            p.add("helm topology", f"{bad} was accepted")
        except Exception as e:
            if "values don't meet the specifications of the schema" not in str(e):
                p.add("helm topology", f"{bad} failed for another reason: {e}")
    print(f"helm topology: {len(docs)} objects; {len(cases)} more value sets checked")


def run(flags: dict[str, set[str]] | None) -> Problems:
    p = Problems()

    base = render_kustomize(BASE)
    check_set("kustomize base", base, "seaweedfs-csi", p, flags)
    kinds = sorted({d["kind"] for d in base})
    print(f"kustomize base: {len(base)} objects: {', '.join(kinds)}")

    for f in sorted(os.listdir(EXAMPLES)):
        if f.endswith(".yaml"):
            docs = load_docs(open(os.path.join(EXAMPLES, f)).read())
            schema_validate(f"examples/{f}", docs, p)
            check_workloads(f"examples/{f}", docs, p, None, set())
            for d in docs:
                if d["kind"] == "StorageClass":
                    if d["provisioner"] != "seaweedfs-csi-driver":
                        p.add(f, "example StorageClass must use the default driver name")
                    for k in d.get("parameters", {}):
                        if k not in KNOWN_SC_PARAMS:
                            p.add(f, f"parameter {k} is not read by the driver")
                if d["kind"] == "PersistentVolume":
                    if d["spec"]["csi"]["driver"] != "seaweedfs-csi-driver":
                        p.add(f, "static PV must use the default driver name")
                    for k in d["spec"]["csi"].get("volumeAttributes", {}):
                        if k not in KNOWN_SC_PARAMS:
                            p.add(f, f"volumeAttribute {k} is not read by the driver")
            print(f"examples/{f}: {len(docs)} objects")

    for e in helm_lint_errors():
        p.add("helm lint", e)

    cases = [
        ("helm defaults", {"seaweedfsFiler": "filer:8888"}, False, set()),
        ("helm go-style values", GO_STYLE_VALUES, False, set()),
        ("helm full values", FULL_VALUES, True, {"filer-client-tls"}),
        ("helm existing configmap", {"security": {"enabled": True, "existingConfigMap": "sec"},
                                     "metrics": {"port": 9400}}, False, {"sec"}),
    ]
    mk8s = "/var/snap/microk8s/common/var/lib/kubelet"
    cases.append(("helm microk8s, no tolerations",
                  {"node": {"tolerations": [],
                            "volumes": {"plugins_dir": f"{mk8s}/plugins",
                                        "pods_mount_dir": f"{mk8s}/pods",
                                        "registration_dir": f"{mk8s}/plugins_registry"}}},
                  False, set()))
    for where, values, attacher, external in cases:
        docs = render_helm(copy.deepcopy(values))
        vols = values.get("node", {}).get("volumes", {})
        dirs = (vols.get("plugins_dir", KUBELET_DIRS[0]), vols.get("pods_mount_dir", KUBELET_DIRS[1]))
        allow_taints = values.get("node", {}).get("tolerations") == []
        check_set(where, docs, "csi", p, flags, attacher, external, dirs, allow_taints,
                  values.get("fsGroupPolicy", "None"))
        print(f"{where}: {len(docs)} objects")
        if allow_taints:
            for d in by_kind(docs, "DaemonSet"):
                if pod_spec(d).get("tolerations"):
                    p.add(where, f"{name_of(d)}: node.tolerations [] must leave no tolerations")

    # Value-driven details that must show up in the output.
    docs = render_helm(copy.deepcopy(FULL_VALUES))
    node = next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d).endswith("-node"))
    plugin = container(node, "seaweedfs-csi-plugin")
    want = ["--cacheCapacityMB=256", "--cacheMetaTtlSec=30", "--concurrentWriters=64",
            "--concurrentReaders=32", "--dataLocality=write_preferLocalDc", "--dataCenter=dc1",
            "--filer=f1:8888,f2:8888", "--driverName=swfs.example.com", "--memoryBudgetMB=768"]
    for w in want:
        if w not in plugin["args"]:
            p.add("helm full values", f"node args lack {w}: {plugin['args']}")
    env = {e["name"]: e.get("value") for e in plugin["env"]}
    if env.get("WEED_GRPC_CA") != "/var/run/secrets/app/tls/ca.crt":
        p.add("helm full values", "tlsSecret does not set WEED_GRPC_CA")
    if env.get("WEED_LOGLEVEL") != "info,seaweedfs_csi_driver=debug":
        p.add("helm full values", "logFilter does not reach WEED_LOGLEVEL")
    mounts = {m["mountPath"] for m in plugin["volumeMounts"]}
    if "/etc/seaweedfs/security.toml" not in mounts:
        p.add("helm full values", "security.toml is not mounted in the node plugin")
    sc = next(d for d in docs if d["kind"] == "StorageClass")
    if sc["parameters"].get("chunkSizeLimitMB") != "8":
        p.add("helm full values", "storageClassParameters must render as strings")
    if sc["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class") != "true":
        p.add("helm full values", "isDefaultStorageClass is not applied")
    gdocs = render_helm(copy.deepcopy(GO_STYLE_VALUES))
    gnode = next(d for d in gdocs if d["kind"] == "DaemonSet" and name_of(d).endswith("-node"))
    genv = {e["name"]: e.get("value") for e in container(gnode, "seaweedfs-csi-plugin")["env"]}
    if genv.get("WEED_V") != "4":
        p.add("helm go-style values", f"logVerbosity 4 should give WEED_V=4, got {genv.get('WEED_V')}")
    if any(a.startswith("--memoryBudgetMB") for a in container(gnode, "seaweedfs-csi-plugin")["args"]):
        p.add("helm go-style values", "no node.memoryBudgetMB must leave the flag to its default")
    if "--cacheCapacityMB=0" not in container(gnode, "seaweedfs-csi-plugin")["args"]:
        p.add("helm go-style values", "cacheCapacityMB: 0 must be passed through")

    check_topology(p, flags)

    # Monitoring: off by default; on, the objects find the pods and their metrics port.
    kinds = {d["kind"] for d in render_helm({"seaweedfsFiler": "filer:8888"})}
    if kinds & {"Service", "ServiceMonitor", "PodMonitor"}:
        p.add("helm defaults", f"monitoring objects rendered while off: {sorted(kinds)}")
    mon = render_helm({"metrics": {"serviceMonitor": {"enabled": True,
                                                      "labels": {"release": "kps"}},
                                   "podMonitor": {"enabled": True}}})
    check_set("helm monitoring", mon, "csi", p, flags)
    check_monitoring("helm monitoring", mon, p)
    got = sorted(f"{d['kind']}/{name_of(d)}" for d in mon
                 if d["kind"] in ("Service", "ServiceMonitor", "PodMonitor"))
    want = ["PodMonitor/swfs", "Service/swfs-controller-metrics", "Service/swfs-node-metrics",
            "ServiceMonitor/swfs"]
    if got != want:
        p.add("helm monitoring", f"monitoring objects {got}, want {want}")
    elif next(d for d in mon if d["kind"] == "ServiceMonitor")["metadata"]["labels"].get(
            "release") != "kps":
        p.add("helm monitoring", "serviceMonitor.labels not applied")
    print(f"helm monitoring: {', '.join(got)}")
    try:
        render_helm({"metrics": {"port": 0, "podMonitor": {"enabled": True}}})
        p.add("helm monitoring", "podMonitor with metrics.port 0 rendered")
    except Exception as e:
        if "need metrics.port" not in str(e):
            p.add("helm monitoring", f"failed for another reason: {e}")

    # values.schema.json: the Go chart's retired values are accepted and NOTES.txt warns about
    # each one; misspelled or unknown values are rejected before anything renders.
    render_helm(copy.deepcopy(GO_STYLE_VALUES))
    retired = ["mountService", "csiSnapshotter", "node.mountEndpoint", "node.mountSocketDir",
               "node.mountHostPath", "node.injectTopologyInfoFromNodeLabel"]
    if "WARNING" not in LAST_NOTES or not all(r in LAST_NOTES for r in retired):
        p.add("helm go-style values", f"NOTES.txt must warn about {retired}: {LAST_NOTES}")
    render_helm({"seaweedfsFiler": "filer:8888"})
    if "WARNING" in LAST_NOTES:
        p.add("helm defaults", f"NOTES.txt warns without retired values: {LAST_NOTES}")
    if "Metrics:" not in LAST_NOTES:
        p.add("helm defaults", "NOTES.txt did not render")
    misspelled = [{"seaweedfsFiller": "f:8888"}, {"nodes": {}}, {"node": {"tolerationz": []}},
                  {"node": {"volumes": {"plugin_dir": "/x"}}}, {"csiAttacher": {"enable": True}},
                  {"controller": {"replica": 2}}, {"metrics": {"prot": 1}},
                  {"fsGroupPolicy": "file"}, {"concurrentWriters": 0},
                  {"node": {"volumes": {"plugins_dir": "relative/path"}}}]
    for bad in misspelled:
        try:
            render_helm(copy.deepcopy(bad))
            p.add("helm values schema", f"{bad} was accepted")
        except Exception as e:
            if "values don't meet the specifications of the schema" not in str(e):
                p.add("helm values schema", f"{bad} failed for another reason: {e}")
    print(f"helm values schema: {len(misspelled)} misspelled/invalid value sets rejected, "
          f"{len(retired)} retired Go values warned about")

    # Misconfiguration must fail loudly, not render something half-right.
    try:
        render_helm({"security": {"enabled": True}})
        p.add("helm", "security.enabled without a source rendered instead of failing")
    except Exception as e:
        if "security.enabled needs" not in str(e):
            p.add("helm", f"security.enabled without a source failed for the wrong reason: {e}")
    return p


def labels_match(sel: Doc, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for e in sel.get("matchExpressions", []):
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
    return True


def check_monitoring(where: str, docs: list[Doc], p: Problems) -> None:
    """Service -> pods (named port), ServiceMonitor -> Services, PodMonitor -> pods."""
    pods = {name_of(d): d for d in by_kind(docs, "Deployment") + by_kind(docs, "DaemonSet")}
    metric_pods = [d for n, d in pods.items() if n.endswith(("-node", "-controller"))]

    def ports(d: Doc) -> set[str]:
        return {q.get("name") for c in pod_spec(d)["containers"] for q in c.get("ports", [])}

    def tlabels(d: Doc) -> dict[str, str]:
        return d["spec"]["template"]["metadata"]["labels"]

    services = by_kind(docs, "Service")
    for s in services:
        hit = [d for d in pods.values() if labels_match({"matchLabels": s["spec"]["selector"]},
                                                         tlabels(d))]
        if len(hit) != 1:
            p.add(where, f"Service {name_of(s)} selects {len(hit)} workloads, want 1")
        for port in s["spec"]["ports"]:
            if hit and port.get("targetPort") not in ports(hit[0]):
                p.add(where, f"Service {name_of(s)} targetPort {port.get('targetPort')} "
                             f"is not a named port of {name_of(hit[0])}")
    for sm in by_kind(docs, "ServiceMonitor"):
        got = [s for s in services if labels_match(sm["spec"]["selector"],
                                                   s["metadata"].get("labels", {}))]
        if len(got) != len(metric_pods) or not got:
            p.add(where, f"ServiceMonitor selects {len(got)} Services, want {len(metric_pods)}")
        names = {q["name"] for s in got for q in s["spec"]["ports"]}
        for e in sm["spec"]["endpoints"]:
            if e["port"] not in names:
                p.add(where, f"ServiceMonitor endpoint port {e['port']} is on no Service")
    for pm in by_kind(docs, "PodMonitor"):
        got = [d for d in pods.values() if labels_match(pm["spec"]["selector"], tlabels(d))]
        if sorted(map(name_of, got)) != sorted(map(name_of, metric_pods)):
            p.add(where, f"PodMonitor selects {sorted(map(name_of, got))}")
        for e in pm["spec"]["podMetricsEndpoints"]:
            for d in got:
                if e["port"] not in ports(d):
                    p.add(where, f"PodMonitor port {e['port']} is not a named port of {name_of(d)}")


# --- helm upgrade from a release installed with the Go driver's chart -------------------------
#
# The API server refuses to change some fields; `helm upgrade` then stops half-way. The facts
# about the Go chart (which objects it makes and their immutable fields, for a release name and
# values) are data in go_chart_immutable.json, so CI needs no network. The fixture holds cases
# from more than one version of the Go chart: "sources" says where each version's facts come
# from (chart version, commit), and every case names the version and commit it was rendered
# from ("go_chart"). To (re)derive the cases of one version from a checkout of the Go chart:
#   check_manifests.py --go-chart DIR [--go-version V] [--go-commit SHA] --write-go-fixture
# V defaults to DIR's Chart.yaml version. A version not in the fixture yet (needs --go-commit)
# gets cases with the release names and values of the first source's cases.

GO_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go_chart_immutable.json")
# API defaults of fields a chart may leave unset (what a live object has).
CSIDRIVER_DEFAULTS = {"attachRequired": True, "podInfoOnMount": False,
                      "fsGroupPolicy": "ReadWriteOnceWithFSType",
                      "volumeLifecycleModes": ["Persistent"]}
# The CSIDriver spec fields the API server refuses to change, by cluster version: all four
# before Kubernetes 1.29; fsGroupPolicy and podInfoOnMount are mutable since.
CSIDRIVER_IMMUTABLE = (("v1.28.0", ["attachRequired", "volumeLifecycleModes", "fsGroupPolicy",
                                    "podInfoOnMount"]),
                       ("v1.30.0", ["attachRequired", "volumeLifecycleModes"]))


def immutable_fields(d: Doc) -> dict[str, Any] | None:
    """The fields of an object that `kubectl apply`/`helm upgrade` cannot change in place."""
    kind, spec = d.get("kind"), d.get("spec", {})
    if kind in ("Deployment", "DaemonSet", "ReplicaSet"):
        return {"spec.selector": spec.get("selector")}
    if kind == "StatefulSet":
        return {"spec.selector": spec.get("selector"), "spec.serviceName": spec.get("serviceName"),
                "spec.volumeClaimTemplates": spec.get("volumeClaimTemplates", []),
                "spec.podManagementPolicy": spec.get("podManagementPolicy", "OrderedReady")}
    if kind == "CSIDriver":
        # all four immutable before Kubernetes 1.29; fsGroupPolicy and podInfoOnMount since.
        return {f"spec.{k}": spec.get(k, dflt) for k, dflt in CSIDRIVER_DEFAULTS.items()}
    if kind == "StorageClass":
        return {"provisioner": d.get("provisioner"), "parameters": d.get("parameters") or {},
                "reclaimPolicy": d.get("reclaimPolicy", "Delete"),
                "volumeBindingMode": d.get("volumeBindingMode", "Immediate")}
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        return {"roleRef": d.get("roleRef")}
    if kind == "Service":
        return {"spec.type": spec.get("type", "ClusterIP"), "spec.clusterIP": spec.get("clusterIP")}
    if kind in ("Secret", "ConfigMap") and d.get("immutable"):
        return {"data": d.get("data"), "stringData": d.get("stringData")}
    return None


def immutable_facts(docs: list[Doc]) -> dict[str, dict[str, Any]]:
    out = {}
    for d in docs:
        f = immutable_fields(d)
        if f is not None:
            out[f"{d['kind']}/{name_of(d)}"] = f
    return out


def load_go_fixture() -> dict[str, Any]:
    with open(GO_FIXTURE) as f:
        return json.load(f)


def chart_version(chart_dir: str) -> str:
    with open(os.path.join(chart_dir, "Chart.yaml")) as f:
        return str(yaml.safe_load(f)["version"])


def our_upgrade_facts(case: Doc) -> dict[str, dict[str, Any]]:
    """Our chart's immutable fields for a case's release name and values, as `helm upgrade`."""
    return immutable_facts(render_helm(copy.deepcopy(case["values"]), case["namespace"],
                                       release=case["release"], is_upgrade=True))


def csidriver_conflicts(ours: dict[str, Any], live_spec: dict[str, Any]) -> dict[str, list[str]]:
    """Per cluster version: the immutable CSIDriver fields our chart would change."""
    return {kv: [f for f in immutable if ours[f"spec.{f}"] != live_spec[f]]
            for kv, immutable in CSIDRIVER_IMMUTABLE}


LOOKUP = 'lookup "storage.k8s.io/v1" "CSIDriver" "" .Values.driverName'
LIVE_NOTES = ""
KUBE_VERSION = ".Capabilities.KubeVersion.Version"


def live_check_render(values: dict[str, Any], live: Doc, kube_version: str) -> str | None:
    """Render a copy of our chart in which csidriver.yaml's `lookup` of the live CSIDriver
    returns `live` (offline rendering has no cluster, so lookup is empty) and the cluster
    version is `kube_version`. None = rendered, else the failure message. The rendered
    NOTES.txt (which looks the CSIDriver up too) is left in LIVE_NOTES."""
    global LIVE_NOTES
    LIVE_NOTES = ""
    import tempfile
    import shutil
    import helm_python as helm

    with tempfile.TemporaryDirectory() as tmp:
        chart = os.path.join(tmp, "seaweedfs-csi-driver")
        shutil.copytree(CHART, chart)
        path = os.path.join(chart, "templates", "csidriver.yaml")
        text = open(path).read()
        if LOOKUP not in text or KUBE_VERSION not in text:
            return "csidriver.yaml does not look up the live CSIDriver and the cluster version"
        text = text.replace(LOOKUP, "fromJson `" + json.dumps(live) + "`")
        text = text.replace(KUBE_VERSION, f'"{kube_version}"')
        with open(path, "w") as f:
            f.write(text)
        notes = os.path.join(chart, "templates", "NOTES.txt")
        text = open(notes).read()
        if LOOKUP not in text:
            return "NOTES.txt does not look up the live CSIDriver"
        with open(notes, "w") as f:
            f.write(text.replace(LOOKUP, "fromJson `" + json.dumps(live) + "`"))
        try:
            with helm.Chart.load(chart) as c:
                out = c.render(values, name="r", namespace="default", is_upgrade=True)
            LIVE_NOTES = next((out[n] for n in out if n.endswith("NOTES.txt")), "")
        except Exception as e:  # HelmRenderError
            return str(e)
    return None


def check_go_upgrade(p: Problems, go_chart: str | None, go_version: str | None = None) -> None:
    fx = load_go_fixture()
    sources = {s["version"]: s for s in fx["sources"]}
    for case in fx["cases"]:
        gc = case.get("go_chart", {})
        src = sources.get(gc.get("version"))
        if src is None or src["commit"] != gc.get("commit"):
            p.add("go_chart_immutable.json", f"case (release {case['release']}) names Go chart "
                                             f"{gc}, which is not one of its sources")
    checked = None
    if go_chart:
        # A values file copied from the Go chart passes our schema and renders.
        with open(os.path.join(go_chart, "values.yaml")) as f:
            go_values = yaml.safe_load(f)
        try:
            render_helm(go_values)
            print("Go chart's values.yaml: accepted")
        except Exception as e:
            p.add("Go chart's values.yaml", f"rejected by our chart: {e}")
        checked = go_version or chart_version(go_chart)
        if checked not in sources:
            p.add("upgrade from Go chart", f"go_chart_immutable.json has no cases for Go chart "
                                           f"{checked} ({go_chart}); add them with "
                                           f"--write-go-fixture")
    for case in fx["cases"]:
        rel, values = case["release"], case["values"]
        version = case["go_chart"]["version"]
        where = f"upgrade from Go chart {version} (release {rel})"
        go = case["immutable"]
        if version == checked:
            # The fixture must still say what the Go chart renders.
            fresh = immutable_facts(render_helm(copy.deepcopy(values), case["namespace"],
                                                go_chart, rel))
            if fresh != go:
                p.add(where, f"go_chart_immutable.json is stale for {go_chart}: "
                             f"{json.dumps(fresh, sort_keys=True)}")
        ours = our_upgrade_facts(case)
        for key, want in go.items():
            if key not in ours:
                print(f"{where}: {key} is removed by the upgrade")
                continue
            if key.startswith("CSIDriver/"):
                continue  # checked below against the live object
            if ours[key] != want:
                p.add(where, f"{key}: immutable fields differ, the upgrade would fail: "
                             f"Go chart {json.dumps(want, sort_keys=True)}, ours "
                             f"{json.dumps(ours[key], sort_keys=True)}")
        # CSIDriver: either identical where immutable, or the chart stops before changing
        # anything, with the one command that fixes it.
        csid = [k for k in go if k.startswith("CSIDriver/")]
        for key in csid:
            live_spec = {k.removeprefix("spec."): v for k, v in go[key].items()}
            live = {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver",
                    "metadata": {"name": key.split("/", 1)[1]}, "spec": live_spec}
            for kv, differs in csidriver_conflicts(ours[key], live_spec).items():
                err = live_check_render(copy.deepcopy(values), live, kv)
                expect = case["expect_csidriver_conflict"][kv]
                if sorted(differs) != sorted(expect):
                    p.add(where, f"Kubernetes {kv}: CSIDriver immutable fields that differ "
                                 f"are {differs}, fixture expects {expect}")
                if differs and (err is None or f"`kubectl delete csidriver {live['metadata']['name']}`"
                                not in err or not all(f in err for f in differs)):
                    p.add(where, f"Kubernetes {kv}: CSIDriver {differs} differ but the chart "
                                 f"did not stop with the fix: {err}")
                if not differs and err is not None:
                    p.add(where, f"Kubernetes {kv}: CSIDriver matches but the chart failed: {err}")
                # an upgrade that goes through and changes whether fsGroup is applied says so
                was, now = live_spec["fsGroupPolicy"], ours[key]["spec.fsGroupPolicy"]
                changes = was != now and "File" in (was, now)
                warned = f"fsGroupPolicy changed from {was} to {now}" in LIVE_NOTES
                if err is None and changes and not (
                        warned and f"--set fsGroupPolicy={was}" in LIVE_NOTES):
                    p.add(where, f"Kubernetes {kv}: fsGroupPolicy goes from {was} to {now} "
                                 f"without a warning in NOTES.txt: {LIVE_NOTES}")
                if err is None and not changes and "fsGroupPolicy changed" in LIVE_NOTES:
                    p.add(where, f"Kubernetes {kv}: NOTES.txt warns of an fsGroupPolicy "
                                 f"change that is not one: {LIVE_NOTES}")
                if err is None and changes:
                    print(f"{where}, Kubernetes {kv}: NOTES.txt warns: fsGroupPolicy {was} -> {now}")
                print(f"{where}, Kubernetes {kv}: CSIDriver "
                      + (f"stops early on {differs}" if differs else "upgrades in place"))
        # and with the cluster's settings kept (the message's alternative), it goes through
        for key in csid:
            live_spec = {k.removeprefix("spec."): v for k, v in go[key].items()}
            keep = copy.deepcopy(values)
            keep.setdefault("csiAttacher", {})["enabled"] = live_spec["attachRequired"]
            keep["fsGroupPolicy"] = live_spec["fsGroupPolicy"]
            err = live_check_render(keep, {"spec": live_spec}, "v1.28.0")
            if err is not None:
                p.add(where, f"keeping the cluster's CSIDriver settings still fails: {err}")
    per_source = []
    for s in fx["sources"]:
        n = sum(1 for c in fx["cases"] if c["go_chart"]["version"] == s["version"])
        per_source.append(f"{s['version']} @{s['commit'][:7]}"
                          + (" reconstructed" if s.get("reconstructed") else "") + f": {n}")
    print(f"upgrade from Go chart: {len(fx['cases'])} cases ({', '.join(per_source)})")
    policies = sorted({f["spec.fsGroupPolicy"] for c in fx["cases"]
                       for k, f in c["immutable"].items() if k.startswith("CSIDriver/")})
    print(f"upgrade from Go chart: live CSIDriver fsGroupPolicy {', '.join(policies)}")


def write_go_fixture(go_chart: str, go_version: str | None, go_commit: str | None) -> None:
    """Regenerate the cases of one Go chart version in go_chart_immutable.json from a
    checkout of that chart; a version not in the fixture yet gets new cases."""
    fx = load_go_fixture()
    version = go_version or chart_version(go_chart)
    src = next((s for s in fx["sources"] if s["version"] == version), None)
    if src is None:
        if not go_commit:
            sys.exit(f"Go chart {version} is not in {GO_FIXTURE} yet: give its --go-commit")
        first = fx["sources"][0]
        src = {"version": version, "commit": go_commit, "repository": first["repository"],
               "chart": first["chart"]}
        fx["sources"].append(src)
        for t in [c for c in fx["cases"] if c["go_chart"]["version"] == first["version"]]:
            case = {"go_chart": {"version": version}, "release": t["release"], "namespace": t["namespace"],
                    "values": copy.deepcopy(t["values"]), "expect_csidriver_conflict": {},
                    "immutable": {}}
            fx["cases"].append(case)
        print(f"added Go chart {version}: review expect_csidriver_conflict of its cases and "
              f"describe the source in {GO_FIXTURE}")
    elif go_commit:
        src["commit"] = go_commit
    for case in fx["cases"]:
        if case["go_chart"].get("version") != version:
            continue
        case["go_chart"] = {"version": version, "commit": src["commit"]}
        case["immutable"] = immutable_facts(render_helm(copy.deepcopy(case["values"]),
                                                        case["namespace"], go_chart,
                                                        case["release"]))
        if not case["expect_csidriver_conflict"]:
            # A new case: start from what our chart does now (the check then pins it).
            ours = our_upgrade_facts(case)
            key = next(k for k in case["immutable"] if k.startswith("CSIDriver/"))
            live_spec = {k.removeprefix("spec."): v for k, v in case["immutable"][key].items()}
            case["expect_csidriver_conflict"] = csidriver_conflicts(ours[key], live_spec)
    with open(GO_FIXTURE, "w") as f:
        json.dump(fx, f, indent=2, sort_keys=False)
        f.write("\n")


def self_test() -> list[str]:
    """The checker must catch what it claims to: break a good render on purpose."""
    failures = []
    good = render_kustomize(BASE)
    mutations = {
        "missing volume": lambda docs: pod_spec(next(d for d in docs if d["kind"] == "DaemonSet"))
        ["volumes"].pop(0),
        "unknown field": lambda docs: next(d for d in docs if d["kind"] == "CSIDriver")["spec"]
        .__setitem__("bogus", True),
        "no surge": lambda docs: next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d) == "seaweedfs-csi-node")["spec"]
        ["updateStrategy"].__setitem__("rollingUpdate", {"maxUnavailable": 1}),
        "driver name drift": lambda docs: next(d for d in docs if d["kind"] == "StorageClass")
        .__setitem__("provisioner", "other"),
        "undefined $(VAR)": lambda docs: container(
            next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d) == "seaweedfs-csi-node"), "seaweedfs-csi-plugin")
        ["args"].append("--nodeid=$(NOPE)"),
        "unknown flag": lambda docs: container(
            next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d) == "seaweedfs-csi-node"), "seaweedfs-csi-plugin")
        ["args"].append("--noSuchFlag=1"),
        "keeper socket mismatch": lambda docs: container(
            next(d for d in docs if d["kind"] == "DaemonSet" and name_of(d) == "seaweedfs-csi-keeper"), "keeper")
        ["args"].__setitem__(1, "--socket=/elsewhere/k.sock"),
    }
    flags = {"driver": {"--endpoint", "--filer", "--nodeid", "--driverName", "--components",
                        "--cacheDir", "--keeperSocket", "--metricsPort"},
             "keeper": {"--socket"}}
    for what, mutate in mutations.items():
        docs = copy.deepcopy(good)
        mutate(docs)
        p = Problems()
        check_set("self-test", docs, "seaweedfs-csi", p, flags)
        if not p.items:
            failures.append(f"self-test: '{what}' was not detected")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flags-json", help='{"driver": [...], "keeper": [...]} accepted by the binary')
    ap.add_argument("--go-chart", default=os.environ.get("GO_CSI_CHART"),
                    help="a checkout of the Go driver's chart (deploy/helm/seaweedfs-csi-driver) "
                         "to check go_chart_immutable.json against (env GO_CSI_CHART)")
    ap.add_argument("--go-version", default=os.environ.get("GO_CSI_CHART_VERSION"),
                    help="which Go chart version of go_chart_immutable.json the checkout is "
                         "(default: its Chart.yaml version; env GO_CSI_CHART_VERSION)")
    ap.add_argument("--go-commit", help="with --write-go-fixture: the checkout's commit "
                                        "(needed for a version not in the fixture yet)")
    ap.add_argument("--write-go-fixture", action="store_true",
                    help="regenerate the cases of the checkout's version from --go-chart")
    args = ap.parse_args()
    if args.write_go_fixture:
        if not args.go_chart:
            ap.error("--write-go-fixture needs --go-chart DIR")
        write_go_fixture(args.go_chart, args.go_version, args.go_commit)
        return 0
    flags = None
    if args.flags_json:
        raw = json.load(open(args.flags_json))
        flags = {k: set(v) for k, v in raw.items()}
    p = run(flags)
    check_go_upgrade(p, args.go_chart, args.go_version)
    if not args.go_chart:
        print("SKIP Go chart cross-check: no checkout given (--go-chart DIR or GO_CSI_CHART); "
              "go_chart_immutable.json is trusted as is")
    problems = p.items + self_test()
    for line in problems:
        print("PROBLEM", line)
    print(f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
