//! Helpers for the CSI integration tests: start the driver binary (or serve the services
//! in-process) on a temp unix socket and talk to it with the generated clients over UDS,
//! exactly like kubelet and the sidecars do.
//!
//! The stager is chosen by `CSI_TEST_STAGER`: unset/`fuse` = the real in-process FUSE stager of
//! the shipped binary; `fake` = `--fakeStager` (bind mounts of scratch directories) of the
//! `seaweedfs-csi-test-support` binary, which exists only with `--features test-support`.
//! Tests that need data to land on the filer check [`Stager::Fuse`].
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use seaweedfs_csi_driver::csi::mounts;
use seaweedfs_csi_driver::pb::csi::controller_client::ControllerClient;
use seaweedfs_csi_driver::pb::csi::identity_client::IdentityClient;
use seaweedfs_csi_driver::pb::csi::node_client::NodeClient;
use seaweedfs_csi_driver::pb::csi::volume_capability::access_mode::Mode;
use seaweedfs_csi_driver::pb::csi::volume_capability::{
    AccessMode, AccessType, BlockVolume, MountVolume,
};
use seaweedfs_csi_driver::pb::csi::*;
use tonic::transport::{Channel, Endpoint, Uri};

/// Which stager the driver under test uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stager {
    Fake,
    Fuse,
}

impl Stager {
    pub fn from_env() -> Self {
        match std::env::var("CSI_TEST_STAGER").as_deref() {
            Ok("fake") => Stager::Fake,
            _ => Stager::Fuse,
        }
    }
}

/// A channel to a unix socket (tonic needs a dummy http URI; the connector ignores it).
pub async fn uds_channel(socket: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = socket.to_path_buf();
    Endpoint::try_from("http://[::1]:50051")
        .expect("static uri")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(120))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?))
            }
        }))
        .await
}

/// Clients for the three services over one connection.
#[derive(Clone)]
pub struct Clients {
    pub identity: IdentityClient<Channel>,
    pub controller: ControllerClient<Channel>,
    pub node: NodeClient<Channel>,
}

impl Clients {
    pub async fn connect(socket: &Path) -> Self {
        let ch = uds_channel(socket)
            .await
            .expect("connect to the CSI socket");
        Clients {
            identity: IdentityClient::new(ch.clone()),
            controller: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
        }
    }
}

/// Unmounts everything below `dir` (deepest/newest first), lazily so even dead or busy mounts go.
pub fn unmount_below(dir: &Path) {
    for _ in 0..10 {
        let mut ms = mounts::mounts_under(dir).unwrap_or_default();
        if ms.is_empty() {
            return;
        }
        ms.sort_by_key(|m| std::cmp::Reverse(m.mount_id));
        for m in ms {
            let _ = nix::mount::umount2(&m.mount_point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// Mount points below `dir` right now.
pub fn mounts_below(dir: &Path) -> Vec<PathBuf> {
    mounts::mounts_under(dir)
        .unwrap()
        .into_iter()
        .map(|m| m.mount_point)
        .collect()
}

/// The driver binary on a temp unix socket, with kubelet-like directories under the same temp
/// dir. Killed by pid and every mount below its dir removed on drop.
pub struct Driver {
    child: Option<Child>,
    /// Owns every path the test uses; mounts below it are cleaned up on drop.
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub stager: Stager,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log_path: PathBuf,
}

/// The shipped binary.
pub fn driver_bin() -> &'static str {
    env!("CARGO_BIN_EXE_seaweedfs-csi-driver")
}

/// The binary that runs a driver with `stager`: `--fakeStager` is a test seam that only the
/// test-support binary has.
pub fn driver_bin_for(stager: Stager) -> &'static str {
    match stager {
        Stager::Fuse => driver_bin(),
        Stager::Fake => match option_env!("CARGO_BIN_EXE_seaweedfs-csi-test-support") {
            Some(bin) => bin,
            None => {
                panic!("the fake stager needs the test-support binary: --features test-support")
            }
        },
    }
}

impl Driver {
    /// Starts the driver with both components against `filer` (host:port).
    pub fn start(filer: &str, extra: &[&str]) -> Driver {
        Self::start_env(filer, extra, &[])
    }

    /// [`Driver::start`] with extra environment variables for the driver process.
    pub fn start_env(filer: &str, extra: &[&str], env: &[(&str, &str)]) -> Driver {
        let dir = tempfile::Builder::new()
            .prefix("csitest")
            .tempdir()
            .unwrap();
        let socket = dir.path().join("plugin/csi.sock");
        let stager = Stager::from_env();
        let mut args = vec![
            format!("--endpoint=unix://{}", socket.display()),
            format!("--filer={filer}"),
            "--nodeid=test-node".to_string(),
            "--logLevel=info,seaweedfs_csi_driver=debug".to_string(),
        ];
        if stager == Stager::Fake {
            args.push(format!(
                "--fakeStager={}",
                dir.path().join("scratch").display()
            ));
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Self::start_raw(dir, socket, stager, args, env)
    }

    /// Like [`Driver::start`] with the real FUSE stager whatever `CSI_TEST_STAGER` says, for
    /// tests about what the mounted filesystem shows.
    pub fn start_fuse(filer: &str, extra: &[&str]) -> Driver {
        let dir = tempfile::Builder::new()
            .prefix("csitest")
            .tempdir()
            .unwrap();
        let socket = dir.path().join("plugin/csi.sock");
        let mut args = vec![
            format!("--endpoint=unix://{}", socket.display()),
            format!("--filer={filer}"),
            "--nodeid=test-node".to_string(),
            "--logLevel=info,seaweedfs_csi_driver=debug".to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_raw(dir, socket, Stager::Fuse, args, vec![])
    }

    /// Starts the binary with exactly these args and env (for flag/env tests).
    pub fn start_raw(
        dir: tempfile::TempDir,
        socket: PathBuf,
        stager: Stager,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Driver {
        let log_path = dir.path().join("driver.log");
        let mut d = Driver {
            child: None,
            dir,
            socket,
            stager,
            args,
            env,
            log_path,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap();
        let mut cmd = Command::new(driver_bin_for(self.stager));
        cmd.args(&self.args)
            .stdout(Stdio::null())
            .stderr(log)
            .env_remove("RUST_LOG")
            // No Kubernetes API unless a test gives one (KUBECONFIG in `env`): a CI runner in
            // a pod must not make the plugin read the real cluster.
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .env_remove("KUBECONFIG");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("start the driver binary");
        self.child = Some(child);
        self.wait_ready();
    }

    /// Waits until the socket answers GetPluginInfo (panics with the log after 30 s).
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!("driver exited early ({status}):\n{}", self.log());
                }
            }
            if self.socket.exists() && std::os::unix::net::UnixStream::connect(&self.socket).is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "driver socket never came up:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub async fn clients(&self) -> Clients {
        Clients::connect(&self.socket).await
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL, like a crashed or OOM-killed plugin; mounts stay behind.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        terminate_child(self.child.take()?)
    }

    /// What a new pod gets: CreateVolume (1 GiB, `name`), NodeStageVolume and
    /// NodePublishVolume into `pod`'s target directory, multi-node multi-writer, as the
    /// provisioner and kubelet do.
    pub async fn provision_and_publish(&self, name: &str, pod: &str) -> PodVolume {
        self.provision_and_publish_sized(name, pod, 1 << 30).await
    }

    /// [`Driver::provision_and_publish`] of a volume of `bytes`.
    pub async fn provision_and_publish_sized(
        &self,
        name: &str,
        pod: &str,
        bytes: i64,
    ) -> PodVolume {
        let c = self.clients().await;
        let vol = c
            .controller
            .clone()
            .create_volume(create_req(name, bytes, &[]))
            .await
            .unwrap()
            .into_inner()
            .volume
            .unwrap();
        let staging = self.staging_path(name);
        let target = self.target_path(pod);
        let mode = Mode::MultiNodeMultiWriter;
        c.node
            .clone()
            .node_stage_volume(stage_req(&vol, &staging, mode))
            .await
            .unwrap();
        c.node
            .clone()
            .node_publish_volume(publish_req(&vol, &staging, &target, false, mode))
            .await
            .unwrap();
        PodVolume {
            vol,
            staging,
            target,
        }
    }

    /// Starts the same command line again (after [`Driver::kill`]/[`Driver::terminate`]).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the driver first");
        self.spawn();
    }

    /// A kubelet-like path below the test dir (not created).
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// Like kubelet: `plugins/kubernetes.io/csi/<driver>/<hash>/globalmount`, created.
    pub fn staging_path(&self, name: &str) -> PathBuf {
        let p = self.path(&format!(
            "kubelet/plugins/kubernetes.io/csi/seaweedfs-csi-driver/{name}/globalmount"
        ));
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    /// Like kubelet: `pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`, parent created only.
    pub fn target_path(&self, pod: &str) -> PathBuf {
        let p = self.path(&format!(
            "kubelet/pods/{pod}/volumes/kubernetes.io~csi/pv/mount"
        ));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        p
    }

    pub fn mounts(&self) -> Vec<PathBuf> {
        mounts_below(self.dir.path())
    }
}

/// A volume staged on this node and published into one pod (see
/// [`Driver::provision_and_publish`]).
pub struct PodVolume {
    pub vol: Volume,
    pub staging: PathBuf,
    pub target: PathBuf,
}

impl PodVolume {
    /// The pod goes away: NodeUnpublishVolume, then NodeUnstageVolume, as kubelet does.
    pub async fn unpublish_and_unstage(&self, c: &Clients) {
        c.node
            .clone()
            .node_unpublish_volume(unpublish_req(&self.vol, &self.target))
            .await
            .unwrap();
        c.node
            .clone()
            .node_unstage_volume(unstage_req(&self.vol, &self.staging))
            .await
            .unwrap();
    }
}

/// SIGTERM, up to 20 s for the process to exit, then SIGKILL; returns the exit status.
pub fn terminate_child(mut c: Child) -> Option<std::process::ExitStatus> {
    unsafe {
        libc::kill(c.id() as i32, libc::SIGTERM);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(s)) = c.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    c.wait().ok()
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
        unmount_below(self.dir.path());
        if std::thread::panicking() {
            eprintln!("---- driver log ----\n{}", self.log());
        }
    }
}

// ---- request builders, as kubelet / the sidecars send them ----

pub fn mount_cap(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume::default())),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn block_cap(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: mode as i32 }),
    }
}

pub fn create_req(name: &str, bytes: i64, params: &[(&str, &str)]) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: (bytes > 0).then_some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap(Mode::MultiNodeMultiWriter)],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        secrets: HashMap::from([("secret-key".to_string(), "do-not-log-me".to_string())]),
        ..Default::default()
    }
}

pub fn stage_req(vol: &Volume, staging: &Path, mode: Mode) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(mount_cap(mode)),
        volume_context: vol.volume_context.clone(),
        secrets: HashMap::from([("secret-key".to_string(), "do-not-log-me".to_string())]),
        ..Default::default()
    }
}

pub fn publish_req(
    vol: &Volume,
    staging: &Path,
    target: &Path,
    readonly: bool,
    mode: Mode,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(mount_cap(mode)),
        readonly,
        volume_context: vol.volume_context.clone(),
        ..Default::default()
    }
}

pub fn unpublish_req(vol: &Volume, target: &Path) -> NodeUnpublishVolumeRequest {
    NodeUnpublishVolumeRequest {
        volume_id: vol.volume_id.clone(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage_req(vol: &Volume, staging: &Path) -> NodeUnstageVolumeRequest {
    NodeUnstageVolumeRequest {
        volume_id: vol.volume_id.clone(),
        staging_target_path: staging.display().to_string(),
    }
}

/// Total bytes `df` shows for the filesystem at `path`.
pub fn df_total(path: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(path).expect("statvfs");
    st.blocks() as u64 * st.fragment_size() as u64
}

/// The gRPC code of a result.
pub fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> tonic::Code {
    match r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    }
}

/// Whether the filer has an entry at `path` (its HTTP API answers 2xx).
pub fn filer_has(filer_http: &str, path: &str) -> bool {
    let out = Command::new("curl")
        .args([
            "-sS",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-H",
            "Accept: application/json",
        ])
        .arg(format!("http://{filer_http}{path}"))
        .output()
        .expect("curl");
    let code = String::from_utf8_lossy(&out.stdout).to_string();
    code.starts_with('2')
}
