//! Command line: the Go driver's flags with the same names (each also from `WEED_<FLAG>`,
//! uppercase, dots as underscores), `-flag` accepted like `--flag`, and the driver setup that
//! follows from them.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{ArgAction, Args, CommandFactory, Parser, Subcommand};

use crate::config::{parse_id_map, MountOptions};
use crate::csi::controller::{ControllerConfig, ControllerService};
use crate::csi::identity::IdentityService;
use crate::csi::node::{NodeConfig, NodeService};
use crate::csi::params::{DataLocality, VolumeDefaults};
use crate::csi::server::{self, BoundListener, CsiServices, Endpoint, ServeError};
use crate::csi::stager::Stager;
use crate::csi::topology::TopologySpec;
use crate::csi::DEFAULT_DRIVER_NAME;
use crate::filer::FilerApi;

#[derive(Debug, Parser)]
#[command(
    name = "seaweedfs-csi-driver",
    version,
    about = "Kubernetes CSI driver for SeaweedFS with an in-process FUSE client",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub driver: DriverArgs,
    #[command(flatten)]
    pub log: LogArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Mount a filer path in the foreground (like `weed mount`).
    Mount(Box<crate::fuse::mount_cmd::MountArgs>),
    /// Hold /dev/fuse descriptors so FUSE sessions survive plugin restarts (sidecar role).
    Keeper(crate::keeper::KeeperArgs),
}

/// Flags of the driver (default mode). Names and defaults follow the Go driver.
#[derive(Debug, Clone, Args)]
pub struct DriverArgs {
    /// CSI endpoint: unix:///path/csi.sock or tcp://host:port
    #[arg(
        long,
        env = "WEED_ENDPOINT",
        default_value = "unix:///tmp/seaweedfs-csi.sock"
    )]
    pub endpoint: String,

    /// Filer address(es), comma-separated (host:port or host:port.grpcPort)
    #[arg(long, env = "WEED_FILER", default_value = "localhost:8888")]
    pub filer: String,

    /// Node id (default: $NODE_ID, then the hostname)
    #[arg(long, env = "WEED_NODEID", default_value = "")]
    pub nodeid: String,

    /// CSI driver name, used by the CSIDriver object and StorageClasses
    #[arg(long = "driverName", env = "WEED_DRIVERNAME", default_value = DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// Components to run: controller, node or both (comma-separated)
    #[arg(long, env = "WEED_COMPONENTS", default_value = "controller,node")]
    pub components: String,

    /// Advertise PUBLISH_UNPUBLISH_VOLUME for csi-attacher (must match CSIDriver attachRequired)
    #[arg(long, env = "WEED_ATTACHER", default_value = "true", num_args = 0..=1,
          default_missing_value = "true", action = ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub attacher: bool,

    /// Directory for per-volume disk caches (<cacheDir>/<sha256 of volume id>)
    #[arg(long = "cacheDir", env = "WEED_CACHEDIR")]
    pub cache_dir: Option<PathBuf>,

    /// Chunk cache capacity in MiB per volume (default: the mount default)
    #[arg(long = "cacheCapacityMB", env = "WEED_CACHECAPACITYMB")]
    pub cache_capacity_mb: Option<u64>,

    /// Memory budget of the node plugin in MiB, shared by every staged volume (dirty write
    /// data may take a quarter of it); 0: none; default: 3/4 of the container's cgroup
    /// memory limit, else 1/4 of the machine's memory
    #[arg(long = "memoryBudgetMB", env = "WEED_MEMORYBUDGETMB")]
    pub memory_budget_mb: Option<u64>,

    /// Metadata cache TTL in seconds
    #[arg(long = "cacheMetaTtlSec", env = "WEED_CACHEMETATTLSEC")]
    pub cache_meta_ttl_sec: Option<u64>,

    /// Concurrent chunk fetches per volume
    #[arg(long = "concurrentReaders", env = "WEED_CONCURRENTREADERS")]
    pub concurrent_readers: Option<usize>,

    /// Concurrent chunk uploads per volume
    #[arg(long = "concurrentWriters", env = "WEED_CONCURRENTWRITERS")]
    pub concurrent_writers: Option<usize>,

    /// Longest wait of a FUSE thread, in microseconds, for the next request after answering
    /// one before it sleeps (0: never; at most 1000; default: 50)
    #[arg(long = "fuseSpinMicros", env = "WEED_FUSESPINMICROS",
          value_parser = clap::value_parser!(u64).range(0..=crate::config::MAX_FUSE_SPIN_US))]
    pub fuse_spin_us: Option<u64>,

    /// Data center of this node (used with dataLocality)
    #[arg(long = "dataCenter", env = "WEED_DATACENTER", default_value = "")]
    pub data_center: String,

    /// Data locality: none or write_preferLocalDc (needs --dataCenter or --dataCenterLabel)
    #[arg(long = "dataLocality", env = "WEED_DATALOCALITY", default_value = "")]
    pub data_locality: String,

    /// Node label whose value is this node's data center when --dataCenter is empty, e.g.
    /// topology.kubernetes.io/zone (read from the Node object; needs `get` on nodes)
    #[arg(
        long = "dataCenterLabel",
        env = "WEED_DATACENTERLABEL",
        default_value = ""
    )]
    pub data_center_label: String,

    /// Map local uid to filer uid: <local>:<filer>,...
    #[arg(long = "map.uid", env = "WEED_MAP_UID", default_value = "")]
    pub map_uid: String,

    /// Map local gid to filer gid: <local>:<filer>,...
    #[arg(long = "map.gid", env = "WEED_MAP_GID", default_value = "")]
    pub map_gid: String,

    /// Go driver's mount-service endpoint; not needed (FUSE runs in this process), ignored
    #[arg(long = "mountEndpoint", env = "WEED_MOUNTENDPOINT")]
    pub mount_endpoint: Option<String>,

    /// Topology reported by NodeGetInfo, comma-separated: Node label keys (their values are
    /// read from this node's Node object; needs `get` on nodes) and/or key=value segments
    #[arg(long = "topologyKeys", env = "WEED_TOPOLOGYKEYS", default_value = "")]
    pub topology_keys: String,

    /// Maximum volumes per node reported to Kubernetes (0 = unlimited)
    #[arg(
        long = "maxVolumesPerNode",
        env = "WEED_MAXVOLUMESPERNODE",
        default_value_t = 0
    )]
    pub max_volumes_per_node: i64,

    /// Port for Prometheus metrics (0 or unset = off)
    #[arg(long = "metricsPort", env = "WEED_METRICSPORT")]
    pub metrics_port: Option<u16>,

    /// fd-keeper socket (the `keeper` sidecar). With it, FUSE sessions survive plugin crashes
    /// and upgrades: a restarted plugin adopts them instead of leaving dead mounts.
    #[arg(long = "keeperSocket", env = "WEED_KEEPERSOCKET")]
    pub keeper_socket: Option<PathBuf>,

    /// Directory where the node records staged volumes, to stage and bind them again by
    /// itself when their FUSE sessions are lost for good (default: `state` next to a unix
    /// endpoint's socket, else /var/lib/seaweedfs-csi/state; empty = off)
    #[arg(long = "stateDir", env = "WEED_STATEDIR")]
    pub state_dir: Option<String>,
}

/// Log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log level or filter (error, warn, info, debug, trace, or an EnvFilter directive);
    /// default: RUST_LOG, then info
    #[arg(long = "logLevel", env = "WEED_LOGLEVEL", global = true)]
    pub log_level: Option<String>,

    /// glog-style verbosity (0-1 info, 2-3 debug, 4+ trace), for WEED_V from the Helm chart
    #[arg(long = "v", env = "WEED_V", global = true)]
    pub v: Option<u8>,

    /// Log format: text or json
    #[arg(long = "logFormat", env = "WEED_LOGFORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    /// Accepted for compatibility with glog flags; ignored (logs always go to stderr)
    #[arg(long = "logtostderr", hide = true, num_args = 0..=1, default_missing_value = "true", global = true)]
    pub logtostderr: Option<String>,

    /// Accepted for compatibility with glog flags; ignored
    #[arg(long = "alsologtostderr", hide = true, num_args = 0..=1, default_missing_value = "true", global = true)]
    pub alsologtostderr: Option<String>,
}

/// Errors in the command line.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("invalid --{flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error("logging: {0}")]
    Logging(String),
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> CliError {
    CliError::Invalid {
        flag,
        reason: reason.into(),
    }
}

/// Rewrites Go-style `-flag` / `-flag=value` into `--flag...` for every long flag we know, so
/// command lines written for the Go driver work unchanged. Short flags (`-h`, `-V`) and values
/// are left alone; nothing after `--` is touched.
pub fn normalize_args(args: impl IntoIterator<Item = OsString>) -> Vec<OsString> {
    normalize_args_for(&Cli::command(), args)
}

/// [`normalize_args`] for another command line built on these flags (the test-support binary).
pub fn normalize_args_for(
    cmd: &clap::Command,
    args: impl IntoIterator<Item = OsString>,
) -> Vec<OsString> {
    let mut longs: Vec<String> = Vec::new();
    let mut shorts: Vec<char> = Vec::new();
    fn collect(c: &clap::Command, longs: &mut Vec<String>, shorts: &mut Vec<char>) {
        for a in c.get_arguments() {
            if let Some(l) = a.get_long() {
                longs.push(l.to_string());
            }
            if let Some(s) = a.get_short() {
                shorts.push(s);
            }
        }
        for sub in c.get_subcommands() {
            collect(sub, longs, shorts);
        }
    }
    collect(cmd, &mut longs, &mut shorts);
    longs.extend(["help".to_string(), "version".to_string()]);
    shorts.extend(['h', 'V']);

    let mut out = Vec::new();
    let mut passthrough = false;
    for (i, arg) in args.into_iter().enumerate() {
        if i == 0 || passthrough {
            out.push(arg);
            continue;
        }
        let Some(s) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if s == "--" {
            passthrough = true;
            out.push(arg);
            continue;
        }
        if let Some(rest) = s.strip_prefix('-').filter(|r| !r.starts_with('-')) {
            let name = rest.split('=').next().unwrap_or("");
            let single_short =
                name.chars().count() == 1 && shorts.contains(&name.chars().next().unwrap_or(' '));
            if name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
                && longs.iter().any(|l| l == name)
                && !single_short
            {
                out.push(OsString::from(format!("-{s}")));
                continue;
            }
        }
        out.push(arg);
    }
    out
}

/// Sets up `tracing`: text (default) or JSON on stderr; level from `--logLevel`, else `--v`,
/// else `RUST_LOG`, else info.
pub fn init_tracing(log: &LogArgs) -> Result<(), CliError> {
    use tracing_subscriber::EnvFilter;
    let filter = if let Some(l) = log.log_level.as_deref().filter(|l| !l.trim().is_empty()) {
        EnvFilter::try_new(l.trim())
            .map_err(|e| CliError::Logging(format!("--logLevel {l:?}: {e}")))?
    } else if let Some(v) = log.v {
        EnvFilter::new(match v {
            0 | 1 => "info",
            2 | 3 => "debug",
            _ => "trace",
        })
    } else {
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
    };
    use std::io::IsTerminal;
    // Colours only on a terminal: container logs and files get plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let res = match log.log_format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    res.map_err(|e| CliError::Logging(e.to_string()))
}

/// Everything the driver needs, derived and validated from [`DriverArgs`].
#[derive(Debug, Clone)]
pub struct DriverPlan {
    pub endpoint: Endpoint,
    pub driver_name: String,
    pub run_controller: bool,
    pub run_node: bool,
    /// Filer addresses (from `--filer`).
    pub filers: Vec<String>,
    pub controller: ControllerConfig,
    pub node: NodeConfig,
    pub keeper_socket: Option<PathBuf>,
    pub metrics_port: Option<u16>,
    /// Where the node records staged volumes (None = off).
    pub state_dir: Option<PathBuf>,
}

impl DriverPlan {
    /// Whether Identity advertises VOLUME_ACCESSIBILITY_CONSTRAINTS: any `--topologyKeys`
    /// entry, whatever the components. The csi-provisioner asks the controller's Identity, so
    /// the controller needs the same `--topologyKeys` as the node plugin (it never reads them
    /// from the API: label keys only matter to the node component).
    pub fn advertises_topology(&self) -> bool {
        self.node.topology.advertised()
    }
}

impl DriverArgs {
    /// `(controller, node)` from `--components`.
    pub fn components(&self) -> Result<(bool, bool), CliError> {
        let (mut controller, mut node) = (false, false);
        for c in self
            .components
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
        {
            match c {
                "controller" => controller = true,
                "node" => node = true,
                other => {
                    return Err(invalid(
                        "components",
                        format!("unknown component {other:?}"),
                    ))
                }
            }
        }
        if !controller && !node {
            return Err(invalid("components", "enable controller, node or both"));
        }
        Ok((controller, node))
    }

    /// `--nodeid`, else `$NODE_ID`, else the hostname.
    pub fn node_id(&self) -> String {
        if !self.nodeid.trim().is_empty() {
            return self.nodeid.trim().to_string();
        }
        if let Ok(id) = std::env::var("NODE_ID") {
            if !id.trim().is_empty() {
                return id.trim().to_string();
            }
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default()
    }

    /// `--topologyKeys` and `--dataCenterLabel`. A bare entry is a Node label key, read from
    /// this node's Node object (the Go driver's meaning); `key=value` is a fixed segment.
    pub fn topology(&self) -> Result<TopologySpec, CliError> {
        let mut spec = TopologySpec::default();
        for item in self
            .topology_keys
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            match item.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => {
                    spec.fixed
                        .insert(k.trim().to_string(), v.trim().to_string());
                }
                Some(_) => return Err(invalid("topologyKeys", format!("empty key in {item:?}"))),
                None if !spec.label_keys.iter().any(|k| k == item) => {
                    spec.label_keys.push(item.to_string())
                }
                None => {}
            }
        }
        let label = self.data_center_label.trim();
        if label.contains(['=', ',']) || label.contains(char::is_whitespace) {
            return Err(invalid(
                "dataCenterLabel",
                format!("{label:?} is not a label key"),
            ));
        }
        spec.data_center_label = (!label.is_empty()).then(|| label.to_string());
        Ok(spec)
    }

    pub fn filers(&self) -> Result<Vec<String>, CliError> {
        let list: Vec<String> = self
            .filer
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if list.is_empty() {
            return Err(invalid("filer", "at least one filer address is required"));
        }
        Ok(list)
    }

    /// Node-wide mount defaults. Like the Go driver, FUSE volumes use umask 000 (kubelet's
    /// fsGroup handling and pod security decide access, not the mount).
    pub fn volume_defaults(&self) -> Result<VolumeDefaults, CliError> {
        let mut base = MountOptions {
            filers: self.filers()?,
            umask: 0,
            ..Default::default()
        };
        if let Some(v) = self.cache_capacity_mb {
            base.cache_capacity_mb = v;
        }
        if let Some(v) = self.cache_meta_ttl_sec {
            base.cache_meta_ttl_sec = v;
        }
        match self.concurrent_readers {
            Some(0) => return Err(invalid("concurrentReaders", "must be at least 1")),
            Some(v) => base.concurrent_readers = v,
            None => {}
        }
        match self.concurrent_writers {
            Some(0) => return Err(invalid("concurrentWriters", "must be at least 1")),
            Some(v) => base.concurrent_writers = v,
            None => {}
        }
        if let Some(v) = self.fuse_spin_us {
            base.fuse_spin_us = v;
        }
        base.uid_map = parse_id_map(&self.map_uid).map_err(|r| invalid("map.uid", r))?;
        base.gid_map = parse_id_map(&self.map_gid).map_err(|r| invalid("map.gid", r))?;
        let data_locality: DataLocality = self
            .data_locality
            .parse()
            .map_err(|r: String| invalid("dataLocality", r))?;
        if data_locality != DataLocality::None
            && self.data_center.trim().is_empty()
            && self.data_center_label.trim().is_empty()
        {
            return Err(invalid(
                "dataLocality",
                "write_preferLocalDc needs --dataCenter or --dataCenterLabel",
            ));
        }
        Ok(VolumeDefaults {
            base,
            cache_root: self.cache_dir.clone(),
            data_center: self.data_center.trim().to_string(),
            data_locality,
        })
    }

    /// `--stateDir`, defaulting to the plugin's own socket directory (a hostPath that outlives
    /// the container, one per driver instance); an empty value turns recording off.
    pub fn state_dir(&self, endpoint: &Endpoint) -> Option<PathBuf> {
        match (self.state_dir.as_deref().map(str::trim), endpoint) {
            (Some(""), _) => None,
            (Some(d), _) => Some(PathBuf::from(d)),
            (None, Endpoint::Unix(sock)) => sock.parent().map(|p| p.join("state")),
            (None, Endpoint::Tcp(_)) => Some(PathBuf::from(crate::csi::state::DEFAULT_STATE_DIR)),
        }
    }

    pub fn plan(&self) -> Result<DriverPlan, CliError> {
        let endpoint: Endpoint = self
            .endpoint
            .parse()
            .map_err(|e: ServeError| invalid("endpoint", e.to_string()))?;
        let (run_controller, run_node) = self.components()?;
        let state_dir = self.state_dir(&endpoint);
        if self.mount_endpoint.is_some() {
            tracing::warn!("--mountEndpoint is ignored: FUSE runs inside this driver, no mount service is used");
        }
        let node_id = self.node_id();
        if run_node && node_id.is_empty() {
            return Err(invalid("nodeid", "no node id: set --nodeid or NODE_ID"));
        }
        if self.max_volumes_per_node < 0 {
            return Err(invalid("maxVolumesPerNode", "must not be negative"));
        }
        Ok(DriverPlan {
            endpoint,
            driver_name: self.driver_name.clone(),
            run_controller,
            run_node,
            filers: self.filers()?,
            controller: ControllerConfig {
                attacher: self.attacher,
            },
            node: NodeConfig {
                node_id,
                max_volumes_per_node: self.max_volumes_per_node,
                topology: self.topology()?,
                defaults: self.volume_defaults()?,
            },
            state_dir,
            keeper_socket: self.keeper_socket.clone(),
            metrics_port: self.metrics_port.filter(|p| *p != 0),
        })
    }
}

/// Serves the CSI services of `plan` until SIGTERM/SIGINT. `stager` is required when the plan
/// runs the node component.
pub async fn run_driver(
    plan: DriverPlan,
    filer: Arc<dyn FilerApi>,
    stager: Option<Arc<dyn Stager>>,
) -> Result<(), ServeError> {
    let identity = IdentityService::new(
        plan.driver_name.clone(),
        filer.clone(),
        plan.advertises_topology(),
    );
    if plan.run_node && plan.node.topology.needs_labels() {
        // Only the node plugin reads its Node object (a controller-only process never calls
        // the API). Checked without calling it: a missing configuration is said once, now,
        // rather than only in the RPCs that need the labels.
        if let Err(e) = crate::csi::topology::check_api_config(&plan.node.node_id).await {
            tracing::error!(error = %e, "--topologyKeys label keys / --dataCenterLabel cannot be read: NodeGetInfo and NodeStage of volumes that need them fail with FAILED_PRECONDITION");
        }
    }
    let controller = plan
        .run_controller
        .then(|| ControllerService::new(filer.clone(), plan.controller.clone()));
    let node = match (plan.run_node, stager) {
        (true, Some(s)) => {
            let node =
                NodeService::new(s, plan.node.clone()).with_state_dir(plan.state_dir.as_deref());
            node.spawn_recovery();
            Some(node)
        }
        (true, None) => {
            return Err(ServeError::Io {
                context: "the node component needs a stager".into(),
                source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
            })
        }
        (false, _) => None,
    };
    tracing::info!(
        driver = %plan.driver_name,
        version = crate::csi::VENDOR_VERSION,
        node_id = %plan.node.node_id,
        controller = plan.run_controller,
        node = plan.run_node,
        attacher = plan.controller.attacher,
        filers = ?plan.filers,
        "starting CSI driver"
    );
    let listener = BoundListener::bind(&plan.endpoint).await?;
    server::serve(
        listener,
        CsiServices {
            identity,
            controller,
            node,
        },
        server::shutdown_signal(),
    )
    .await
}

/// A command's result as the process exit code; an error is logged and printed first.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        let argv = std::iter::once("seaweedfs-csi-driver")
            .chain(args.iter().copied())
            .map(OsString::from);
        Cli::try_parse_from(normalize_args(argv)).unwrap()
    }

    #[test]
    fn go_style_single_dash_flags_work() {
        let cli = parse(&[
            "-endpoint=unix:///csi/csi.sock",
            "-filer",
            "f1:8888,f2:8888",
            "-nodeid=n1",
            "-driverName=x.csi",
            "-components=node",
            "-map.uid=1000:0",
            "-cacheCapacityMB=0",
            "-attacher=false",
            "-v=4",
        ]);
        assert!(cli.command.is_none());
        let d = &cli.driver;
        assert_eq!(d.endpoint, "unix:///csi/csi.sock");
        assert_eq!(
            d.filers().unwrap(),
            vec!["f1:8888".to_string(), "f2:8888".to_string()]
        );
        assert_eq!(d.node_id(), "n1");
        assert_eq!(d.driver_name, "x.csi");
        assert_eq!(d.components().unwrap(), (false, true));
        assert!(!d.attacher);
        assert_eq!(d.cache_capacity_mb, Some(0));
        assert_eq!(cli.log.v, Some(4));
        let defaults = d.volume_defaults().unwrap();
        assert_eq!(defaults.base.uid_map, vec![(1000, 0)]);
        assert_eq!(defaults.base.umask, 0);
    }

    #[test]
    fn fuse_spin_micros_reaches_the_mounts_within_its_range() {
        let base = |args: &[&str]| parse(args).driver.volume_defaults().unwrap().base;
        assert_eq!(base(&["--filer=a:1"]).fuse_spin_us, 50);
        assert_eq!(base(&["--filer=a:1", "-fuseSpinMicros=0"]).fuse_spin_us, 0);
        assert_eq!(
            base(&["--filer=a:1", "--fuseSpinMicros=1000"]).fuse_spin_us,
            1000
        );
        for bad in ["--fuseSpinMicros=1001", "--fuseSpinMicros=-1"] {
            let argv = ["seaweedfs-csi-driver", "--filer=a:1", bad].map(OsString::from);
            assert!(Cli::try_parse_from(normalize_args(argv)).is_err(), "{bad}");
        }
    }

    #[test]
    fn double_dash_and_defaults() {
        let cli = parse(&[
            "--filer=a:1",
            "--attacher",
            "--logFormat=json",
            "--mountEndpoint=unix:///x",
        ]);
        let d = &cli.driver;
        assert!(d.attacher);
        assert_eq!(d.endpoint, "unix:///tmp/seaweedfs-csi.sock");
        assert_eq!(d.driver_name, "seaweedfs-csi-driver");
        assert_eq!(d.components().unwrap(), (true, true));
        assert_eq!(cli.log.log_format, LogFormat::Json);
        let plan = d.plan().unwrap();
        assert_eq!(
            plan.endpoint,
            Endpoint::Unix("/tmp/seaweedfs-csi.sock".into())
        );
        // Unset tuning flags keep the mount defaults.
        assert_eq!(
            plan.node.defaults.base.cache_capacity_mb,
            MountOptions::default().cache_capacity_mb
        );
        let cli = parse(&[]);
        assert!(
            cli.driver.attacher,
            "attacher defaults to true like the Go driver"
        );
    }

    #[test]
    fn mount_subcommand_and_its_go_style_flags() {
        let cli = parse(&[
            "mount",
            "-filer=a:1",
            "-filer.path=/buckets/b",
            "-dir=/mnt/x",
        ]);
        match cli.command {
            Some(Command::Mount(m)) => {
                assert_eq!(m.filer, "a:1");
                assert_eq!(m.filer_path, "/buckets/b");
                assert_eq!(m.dir, PathBuf::from("/mnt/x"));
            }
            other => panic!("expected mount, got {other:?}"),
        }
    }

    #[test]
    fn normalization_leaves_values_and_short_flags_alone() {
        let argv: Vec<OsString> = ["bin", "-h", "-filer", "-x", "--", "-filer"]
            .iter()
            .map(OsString::from)
            .collect();
        let out: Vec<String> = normalize_args(argv)
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert_eq!(out, vec!["bin", "-h", "--filer", "-x", "--", "-filer"]);
    }

    #[test]
    fn bad_values_are_rejected() {
        let bad = |args: &[&str]| parse(args).driver.plan().unwrap_err().to_string();
        assert!(bad(&["--components=controller,bogus"]).contains("components"));
        assert!(bad(&["--components="]).contains("components"));
        assert!(bad(&["--endpoint=http://x"]).contains("endpoint"));
        assert!(bad(&["--dataLocality=write_preferLocalDc"]).contains("dataCenter"));
        assert!(bad(&["--dataLocality=sideways"]).contains("dataLocality"));
        assert!(bad(&["--map.gid=7"]).contains("map.gid"));
        assert!(bad(&["--concurrentWriters=0"]).contains("concurrentWriters"));
        assert!(bad(&["--topologyKeys==v"]).contains("topologyKeys"));
        assert!(bad(&["--dataCenterLabel=a=b"]).contains("dataCenterLabel"));
        // As the chart's schema: one label key, nothing else.
        assert!(bad(&["--dataCenterLabel=a b"]).contains("dataCenterLabel"));
    }

    #[test]
    fn topology_keys_mix_node_labels_and_fixed_segments() {
        let plan = parse(&[
            "--topologyKeys=zone=a, topology.kubernetes.io/region=r1 ,topology.kubernetes.io/zone,,example.com/rack,topology.kubernetes.io/zone",
        ])
        .driver
        .plan()
        .unwrap();
        let t = &plan.node.topology;
        assert_eq!(t.fixed.len(), 2);
        assert_eq!(t.fixed["zone"], "a");
        assert_eq!(t.fixed["topology.kubernetes.io/region"], "r1");
        // Bare keys are Node labels to read (the Go driver's meaning), once each, in order.
        assert_eq!(
            t.label_keys,
            vec!["topology.kubernetes.io/zone", "example.com/rack"]
        );
        assert_eq!(t.data_center_label, None);
        assert!(t.advertised() && t.needs_labels());

        let plan = parse(&["--topologyKeys=zone=a"]).driver.plan().unwrap();
        assert!(plan.node.topology.advertised() && !plan.node.topology.needs_labels());
        assert_eq!(
            parse(&[]).driver.plan().unwrap().node.topology,
            TopologySpec::default()
        );
    }

    #[tokio::test]
    async fn a_controller_alone_with_topology_keys_advertises_accessibility_constraints() {
        use crate::csi::identity::IdentityService;
        use crate::pb::csi::identity_server::Identity;
        use crate::pb::csi::plugin_capability::{service, Type};

        let advertised = |args: &[&str]| {
            let plan = parse(args).driver.plan().unwrap();
            assert!(plan.run_controller && !plan.run_node, "{args:?}");
            plan.advertises_topology()
        };
        // The provisioner reads the controller's capabilities: a controller-only process with
        // the node plugin's --topologyKeys (label keys included, no node id) advertises them.
        let args = [
            "--components=controller",
            "--topologyKeys=topology.kubernetes.io/zone",
        ];
        assert!(advertised(&args));
        assert!(advertised(&[
            "--components=controller",
            "--topologyKeys=zone=a"
        ]));
        assert!(!advertised(&["--components=controller"]));
        assert!(!advertised(&[
            "--components=controller",
            "--dataCenterLabel=topology.kubernetes.io/zone"
        ]));

        let plan = parse(&args).driver.plan().unwrap();
        let filer = Arc::new(crate::filer::mock::MockFiler::new());
        let identity = IdentityService::new("d", filer, plan.advertises_topology());
        let caps = identity
            .get_plugin_capabilities(tonic::Request::new(Default::default()))
            .await
            .unwrap()
            .into_inner()
            .capabilities;
        assert!(
            caps.iter().any(|c| matches!(&c.r#type,
                Some(Type::Service(s)) if s.r#type == service::Type::VolumeAccessibilityConstraints as i32)),
            "{caps:?}"
        );
    }

    #[test]
    fn data_center_label_stands_in_for_data_center() {
        let plan = parse(&[
            "-dataLocality=write_preferLocalDc",
            "-dataCenterLabel=topology.kubernetes.io/zone",
        ])
        .driver
        .plan()
        .unwrap();
        let t = &plan.node.topology;
        assert_eq!(
            t.data_center_label.as_deref(),
            Some("topology.kubernetes.io/zone")
        );
        assert!(!t.advertised(), "no topology keys: nothing advertised");
        assert!(t.needs_labels());
        assert_eq!(
            plan.node.defaults.data_center, "",
            "resolved per node at stage time"
        );
        // An explicit --dataCenter stays the node default.
        let plan = parse(&["--dataCenter=dc1", "--dataCenterLabel=zone"])
            .driver
            .plan()
            .unwrap();
        assert_eq!(plan.node.defaults.data_center, "dc1");
    }

    #[test]
    fn state_dir_defaults_next_to_the_socket_and_can_be_turned_off() {
        let plan = |args: &[&str]| parse(args).driver.plan().unwrap().state_dir;
        assert_eq!(
            plan(&["--endpoint=unix:///csi/csi.sock"]),
            Some(PathBuf::from("/csi/state"))
        );
        assert_eq!(
            plan(&["--endpoint=tcp://127.0.0.1:1"]),
            Some(PathBuf::from(crate::csi::state::DEFAULT_STATE_DIR))
        );
        assert_eq!(plan(&["--stateDir=/x/y"]), Some(PathBuf::from("/x/y")));
        assert_eq!(plan(&["--stateDir="]), None);
    }

    #[test]
    fn env_vars_set_flags() {
        // Env is process-wide: use names no other test reads.
        std::env::set_var("WEED_MAP_GID", "5:6");
        std::env::set_var("WEED_CONCURRENTREADERS", "9");
        let cli = parse(&[]);
        std::env::remove_var("WEED_MAP_GID");
        std::env::remove_var("WEED_CONCURRENTREADERS");
        assert_eq!(cli.driver.map_gid, "5:6");
        assert_eq!(cli.driver.concurrent_readers, Some(9));
    }
}
