//! Leader election (src/lease.rs) on the real API server, with a 4 s Lease (renewed 2 s before expiry):
//! two contenders, exactly one leads; a crashed leader (its runtime torn
//! down, nothing released) is replaced within about the lease duration; a
//! graceful shutdown hands over; a leader cut off from the API server steps
//! down before the standby may take over.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use agents::lease::LeaderElection;
use k8s_openapi::api::coordination::v1::Lease;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use support::TestNamespace;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const DURATION: Duration = Duration::from_secs(4);
const GRACE: Duration = Duration::from_secs(2);
const LEASE: &str = "agents-test";

/// A client for the test cluster, optionally through another address (the
/// API server's certificate names 127.0.0.1, so a local proxy verifies).
async fn client_via(server: Option<SocketAddr>) -> Client {
    let path = support::kubeconfig_path().expect("kubeconfig");
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    if let Some(addr) = server {
        config.cluster_url = format!("https://{addr}").parse().unwrap();
    }
    Client::try_from(config).unwrap()
}

/// A contender in its own runtime, so it can crash: tearing the runtime
/// down drops its tasks mid-flight and releases nothing, like SIGKILL.
struct Contender {
    name: String,
    runtime: Option<tokio::runtime::Runtime>,
    election: Option<LeaderElection>,
    leading: watch::Receiver<bool>,
}

impl Contender {
    fn start(ns: &str, name: &str, via: Option<SocketAddr>) -> Contender {
        let (ns, name2) = (ns.to_string(), name.to_string());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let election = runtime.block_on(async {
                LeaderElection::new(client_via(via).await, &ns, LEASE, &name2, DURATION, GRACE)
                    .await
                    .unwrap()
            });
            let leading = election.watch();
            Contender {
                name: name2,
                runtime: Some(runtime),
                election: Some(election),
                leading,
            }
        })
        .join()
        .unwrap()
    }

    fn leads(&self) -> bool {
        *self.leading.borrow()
    }

    /// Dies without releasing anything.
    fn crash(mut self) {
        self.runtime.take().unwrap().shutdown_background();
        drop(self.election.take());
    }

    /// Releases the Lease and waits for it.
    async fn shutdown(mut self) {
        let election = self.election.take().unwrap();
        let runtime = self.runtime.take().unwrap();
        let handle = runtime.handle().clone();
        handle
            .spawn(async move { election.shutdown().await })
            .await
            .unwrap();
        runtime.shutdown_background();
    }
}

impl Drop for Contender {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn holder(client: &Client, ns: &str) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), ns)
        .get(LEASE)
        .await
        .unwrap()
        .spec?
        .holder_identity
}

/// Waits until exactly one of `contenders` leads; returns its index.
async fn wait_for_one_leader(contenders: &[&Contender], within: Duration) -> usize {
    let start = Instant::now();
    loop {
        let leaders: Vec<usize> = (0..contenders.len())
            .filter(|i| contenders[*i].leads())
            .collect();
        assert!(leaders.len() <= 1, "two leaders at once: {leaders:?}");
        if let [one] = leaders[..] {
            return one;
        }
        assert!(start.elapsed() < within, "no leader within {within:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Samples both contenders for `period`: never two leaders, never none.
async fn exactly_one_leads_throughout(a: &Contender, b: &Contender, period: Duration) -> String {
    let start = Instant::now();
    let first = if a.leads() { &a.name } else { &b.name }.clone();
    while start.elapsed() < period {
        assert!(
            a.leads() != b.leads(),
            "after {:?}: {} leads: {}, {} leads: {}",
            start.elapsed(),
            a.name,
            a.leads(),
            b.name,
            b.leads()
        );
        let now = if a.leads() { &a.name } else { &b.name };
        assert_eq!(now, &first, "leadership moved while the leader was healthy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_and_takeover_after_a_crash() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "lease-crash").await;
    let a = Contender::start(&ns.name, "replica-a", None);
    let b = Contender::start(&ns.name, "replica-b", None);

    let first = wait_for_one_leader(&[&a, &b], Duration::from_secs(10)).await;
    // Over three lease periods (several renewals) the leader stays, alone.
    let leader = exactly_one_leads_throughout(&a, &b, 3 * DURATION).await;
    assert_eq!(leader, [&a.name, &b.name][first].clone());
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some(leader.as_str())
    );

    let (dead, standby) = if a.leads() { (a, b) } else { (b, a) };
    let crashed = Instant::now();
    dead.crash();
    let takeover = wait_for_one_leader(&[&standby], 3 * DURATION).await;
    assert_eq!(takeover, 0);
    let took = crashed.elapsed();
    println!(
        "lease takeover after a crash: {:.2} s (lease duration {} s, grace {} s)",
        took.as_secs_f64(),
        DURATION.as_secs(),
        GRACE.as_secs()
    );
    // Expiry (at most the duration after the last renewal) plus the
    // library's random 0.1-1 s pause, plus API calls on a busy machine.
    assert!(took <= DURATION + Duration::from_secs(2), "took {took:?}");
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some(standby.name.as_str())
    );
    drop(standby);
    ns.delete(&client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_releases_and_hands_over() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "lease-release").await;
    let a = Contender::start(&ns.name, "replica-a", None);
    wait_for_one_leader(&[&a], Duration::from_secs(10)).await;
    let b = Contender::start(&ns.name, "replica-b", None);
    exactly_one_leads_throughout(&a, &b, DURATION).await;
    assert!(a.leads(), "the first contender keeps the Lease");

    let stopped = Instant::now();
    a.shutdown().await;
    // Released: nobody holds it until the standby looks again.
    let now = holder(&client, &ns.name).await;
    assert!(
        now.is_none() || now.as_deref() == Some("replica-b"),
        "after release the holder is {now:?}"
    );
    wait_for_one_leader(&[&b], 2 * DURATION).await;
    let took = stopped.elapsed();
    println!(
        "lease handover after a graceful shutdown: {:.2} s",
        took.as_secs_f64()
    );
    assert!(
        took <= DURATION + Duration::from_millis(1500),
        "took {took:?}"
    );
    drop(b);
    ns.delete(&client).await;
}

/// A TCP proxy to the API server that can be cut like a network partition:
/// connections stay open but nothing passes any more.
struct Partition {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
}

async fn partition_proxy(upstream: SocketAddr) -> Partition {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (cut, cut_rx) = watch::channel(false);
    tokio::spawn(async move {
        loop {
            let Ok((mut down, _)) = listener.accept().await else {
                return;
            };
            let mut cut = cut_rx.clone();
            tokio::spawn(async move {
                if *cut.borrow() {
                    // Black hole: hold the socket, answer nothing.
                    std::future::pending::<()>().await;
                }
                let Ok(mut up) = TcpStream::connect(upstream).await else {
                    return;
                };
                let cut_now = async {
                    let _ = cut.wait_for(|c| *c).await;
                };
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut down, &mut up) => return,
                    _ = cut_now => {}
                }
                // Hold both sockets open, pass nothing.
                std::future::pending::<()>().await;
            });
        }
    });
    Partition { addr, cut }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_steps_down_before_the_standby_takes_over() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "lease-partition").await;
    let path = support::kubeconfig_path().unwrap();
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    let upstream: SocketAddr = format!(
        "{}:{}",
        config.cluster_url.host().unwrap(),
        config.cluster_url.port_u16().unwrap_or(443)
    )
    .parse()
    .unwrap();
    let proxy = partition_proxy(upstream).await;

    let a = Contender::start(&ns.name, "replica-a", Some(proxy.addr));
    wait_for_one_leader(&[&a], Duration::from_secs(10)).await;
    let b = Contender::start(&ns.name, "replica-b", None);
    exactly_one_leads_throughout(&a, &b, DURATION).await;
    assert!(a.leads());

    let cut = Instant::now();
    proxy.cut.send_replace(true);
    let (a_election, b_election) = (a.election.as_ref().unwrap(), b.election.as_ref().unwrap());
    let stepped_down = tokio::time::timeout(3 * DURATION, async {
        a_election.lost().await;
        cut.elapsed()
    });
    let took_over = tokio::time::timeout(3 * DURATION, async {
        b_election.elected().await;
        cut.elapsed()
    });
    let (stepped_down, took_over) = tokio::join!(stepped_down, took_over);
    let stepped_down = stepped_down.expect("the cut-off leader never stepped down");
    let took_over = took_over.expect("the standby never took over");
    println!(
        "partition: the cut-off leader stepped down after {:.2} s, the standby led after {:.2} s",
        stepped_down.as_secs_f64(),
        took_over.as_secs_f64()
    );
    assert!(
        stepped_down < took_over,
        "the old leader stepped down ({stepped_down:?}) only after the new one led ({took_over:?})"
    );
    assert!(stepped_down <= DURATION, "{stepped_down:?}");
    assert_eq!(
        holder(&client, &ns.name).await.as_deref(),
        Some("replica-b")
    );
    drop(a);
    drop(b);
    ns.delete(&client).await;
}
