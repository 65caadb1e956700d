//! Multi-process tests over TCP on loopback. The test binary re-executes itself as the worker
//! processes (the `tcp_worker` test does nothing unless the worker environment is set).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use wagma::engine::{ContributionMode, ReadMode, Trigger};
use wagma::exec::threaded;
use wagma::topology::{Grouping, GroupingKind};
use wagma::transport::tcp::{Credentials, TcpConfig, env};
use wagma::{EngineConfig, Error, Payload, block_on};

const ROLE: &str = "WAGMA_TEST_TCP_ROLE";
const TIMEOUT: &str = "WAGMA_TEST_TIMEOUT_S";

#[test]
fn tcp_worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let code = match worker(&role) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("WORKER-ERROR: {e}");
            3
        }
    };
    std::process::exit(code);
}

fn worker(role: &str) -> Result<(), Error> {
    let tcp = TcpConfig::from_env()?;
    let timeout = std::env::var(TIMEOUT)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let cfg = EngineConfig {
        timeout: Duration::from_secs(timeout),
        ..EngineConfig::default()
    };
    let (mut c, engine) = threaded::connect_tcp(&tcp, cfg)?;
    println!("READY {}", c.rank());
    std::io::stdout().flush().ok();
    let (p, rank) = (c.size(), c.rank());
    let result = block_on(async {
        match role {
            "collectives" => {
                for len in [0usize, 5, 100_000] {
                    let got = c
                        .allreduce(Payload::Data(model(rank, len as u64, len)))
                        .await?;
                    let want: Vec<f64> = (0..len)
                        .map(|i| (0..p).map(|r| value(r, len as u64, i) as f64).sum())
                        .collect();
                    assert!(close(got.as_slice(), &want), "global allreduce of {len}");
                }
                let (s, tau, len) = (2, Some(3), 1000);
                let g = Grouping::new(p, s, GroupingKind::Butterfly)?;
                let mut cfg = stream(
                    s,
                    GroupingKind::Butterfly,
                    Trigger::Solo,
                    ContributionMode::Model,
                    ReadMode::Latest,
                    tau,
                    vec![],
                );
                cfg.initial = Payload::Data(model(rank, 0, len));
                c.open_stream(cfg).await?;
                for t in 0..12u64 {
                    c.compute(ms(((rank as u64 * 7 + t * 3) % 5) * 3)).await;
                    let r = c
                        .arrive(t, Payload::Data(model(rank, t + 1, len)), t + 1)
                        .await?;
                    check_round(rank, &r, &g, tau, len);
                }
                Ok(())
            }
            "long" => {
                let mut x = Payload::Data(vec![1.0; 1000]);
                for _ in 0..600 {
                    c.compute(ms(50)).await;
                    x = c.allreduce(x).await?;
                    x.scale(1.0 / p as f32);
                }
                Ok(())
            }
            other => panic!("unknown role {other}"),
        }
    });
    match result {
        Ok(()) => {
            block_on(c.finish())?;
            let _ = engine.join();
            Ok(())
        }
        Err(e) => Err(e),
    }
}

struct Job {
    children: Vec<Child>,
    ready: mpsc::Receiver<usize>,
    rendezvous: String,
    /// Holds the rendezvous file until the job ends.
    _dir: TempDir,
}

/// Starts rank `rank` as a child process. Rank 0 gets `rdv_file`: it binds `rdv` (port 0)
/// and writes the address it got there.
fn spawn_one(
    rank: usize,
    p: usize,
    role: &str,
    rdv: &str,
    rdv_file: Option<&Path>,
    timeout_s: u64,
    tx: mpsc::Sender<usize>,
) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    match rdv_file {
        Some(file) => cmd.env(env::RENDEZVOUS_FILE, file),
        None => cmd.env_remove(env::RENDEZVOUS_FILE),
    };
    let mut child = cmd
        .args(["--exact", "tcp_worker", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(TIMEOUT, timeout_s.to_string())
        .env(env::RANK, rank.to_string())
        .env(env::WORLD_SIZE, p.to_string())
        .env(env::RENDEZVOUS, rdv)
        .env(env::JOB_ID, "tcp-test")
        .env(env::SECRET, "correct horse")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.contains("READY") {
                let _ = tx.send(rank);
            }
        }
    });
    child
}

impl Job {
    /// Rank 0 binds its rendezvous on port 0 (the OS picks a free port, which nobody else
    /// can take while it listens) and writes the address to a file in a fresh directory; the
    /// other ranks start once it is there, with the real address.
    fn start(p: usize, role: &str, timeout_s: u64, before_others: impl FnOnce(&str)) -> Job {
        let dir = TempDir::new("tcp-rendezvous");
        let file = dir.path().join("rendezvous");
        let (tx, ready) = mpsc::channel();
        let mut rank0 = spawn_one(
            0,
            p,
            role,
            "127.0.0.1:0",
            Some(&file),
            timeout_s,
            tx.clone(),
        );
        let rendezvous = await_rendezvous(&file, || {
            let status = rank0.try_wait().unwrap()?;
            let mut err = String::new();
            rank0.stderr.take()?.read_to_string(&mut err).ok();
            Some(format!("{status}: {err}"))
        });
        let mut children = vec![rank0];
        before_others(&rendezvous);
        for rank in 1..p {
            children.push(spawn_one(
                rank,
                p,
                role,
                &rendezvous,
                None,
                timeout_s,
                tx.clone(),
            ));
        }
        Job {
            children,
            ready,
            rendezvous,
            _dir: dir,
        }
    }

    /// Waits for every child; returns (exit code, stderr) per rank and the time taken.
    fn wait(mut self, limit: Duration) -> Vec<(Option<i32>, String)> {
        let deadline = Instant::now() + limit;
        let mut out = vec![None; self.children.len()];
        while out.iter().any(Option::is_none) {
            for (i, c) in self.children.iter_mut().enumerate() {
                if out[i].is_none()
                    && let Some(status) = c.try_wait().unwrap()
                {
                    let mut err = String::new();
                    c.stderr.take().unwrap().read_to_string(&mut err).ok();
                    out[i] = Some((status.code(), err));
                }
            }
            if Instant::now() > deadline {
                for c in &mut self.children {
                    let _ = c.kill();
                }
                panic!("the job did not end within {limit:?}: {out:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        out.into_iter().map(Option::unwrap).collect()
    }
}

/// Connects like a rank would, with the wrong secret.
fn intruder(rdv: &str) -> wagma::error::TransportError {
    let mut cfg = TcpConfig::new(
        1,
        4,
        rdv,
        Credentials {
            job_id: "tcp-test".into(),
            secret: b"guess".to_vec(),
        },
    );
    cfg.connect_timeout = Duration::from_secs(10);
    let (tx, _rx) = crossbeam_channel::unbounded();
    match wagma::transport::tcp::connect(&cfg, tx) {
        Ok(_) => panic!("a wrong secret must be refused"),
        Err(e) => e,
    }
}

#[test]
fn four_processes_agree_with_the_reference_and_refuse_intruders() {
    let mut refused = None;
    let job = Job::start(4, "collectives", 30, |rdv| {
        // Garbage bytes on the rendezvous port, then a peer with the wrong secret.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut s = loop {
            match std::net::TcpStream::connect(rdv) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Err(e) => panic!("rank 0 never listened: {e}"),
            }
        };
        s.write_all(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9])
            .unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
        refused = Some(intruder(rdv));
    });
    let rendezvous = job.rendezvous.clone();
    let results = job.wait(Duration::from_secs(120));
    for (rank, (code, err)) in results.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank} failed: {err}");
    }
    let refused = refused.unwrap();
    assert!(
        matches!(refused, wagma::error::TransportError::Handshake(_)),
        "{refused}"
    );
    assert!(rendezvous.starts_with("127.0.0.1:"));
}

#[test]
fn killing_a_process_fails_every_survivor_naming_it() {
    let timeout_s = 5;
    let mut job = Job::start(4, "long", timeout_s, |_| {});
    for _ in 0..4 {
        job.ready
            .recv_timeout(Duration::from_secs(60))
            .expect("ranks connect");
    }
    std::thread::sleep(Duration::from_millis(500));
    job.children[2].kill().unwrap();
    // No wall-clock bound on how fast the survivors notice: on a loaded machine process
    // start-up and scheduling can take seconds. What matters is checked below: each survivor
    // fails naming rank 2 as lost (a survivor that missed the kill would fail with its own
    // timeout instead, which names no lost peer). The generous limit only stops a hung job
    // (`wait` panics); a correct job ends within about one timeout, 24 times less.
    let results = job.wait(Duration::from_secs(24 * timeout_s));
    for (rank, (code, err)) in results.iter().enumerate() {
        if rank == 2 {
            continue;
        }
        assert_eq!(*code, Some(3), "rank {rank} should fail: {err}");
        assert!(
            err.contains("lost rank 2"),
            "rank {rank} must name the dead peer: {err}"
        );
    }
}

fn note(from: usize, seq: u64) -> wagma::transport::Envelope {
    use wagma::transport::{Envelope, Kind, Meta, Tag};
    Envelope {
        from,
        tag: Tag {
            kind: Kind::Collective,
            seq,
            step: 0,
        },
        meta: Meta::default(),
        data: Payload::Data(vec![seq as f32; 3]),
    }
}

#[test]
fn a_restarted_rank_reconnects_to_every_living_peer() {
    use wagma::transport::tcp::{TcpTransport, connect};
    use wagma::transport::{Incoming, Transport};
    let cred = job_credentials("rejoin");
    let config = |rank: usize, rdv: &str, rejoin: bool| {
        let mut c = TcpConfig::new(rank, 3, rdv, cred.clone());
        c.connect_timeout = Duration::from_secs(20);
        c.accept_rejoins = true;
        c.rejoin = rejoin;
        c
    };
    let open = |c: TcpConfig| {
        let (tx, rx) = crossbeam_channel::unbounded::<Incoming>();
        connect(&c, tx).map(|t| (t, rx))
    };
    // Rank 0 binds the rendezvous on port 0 and writes the address it got; ranks 1 and 2
    // start once it is there.
    let dir = TempDir::new("tcp-rejoin");
    let file = dir.path().join("rendezvous");
    let mut c0 = config(0, "127.0.0.1:0", false);
    c0.rendezvous_file = Some(file.clone());
    let mut rank0 = Some(std::thread::spawn(move || open(c0)));
    let rdv = await_rendezvous(&file, || {
        if !rank0.as_ref()?.is_finished() {
            return None;
        }
        Some(match rank0.take()?.join() {
            Ok(Ok(_)) => "it connected without its peers".to_string(),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "it panicked".to_string(),
        })
    });
    let cfg = |rank: usize, rejoin: bool| config(rank, &rdv, rejoin);
    let mut starting = vec![rank0.expect("rank 0 is still connecting")];
    starting.extend((1..3).map(|r| {
        let c = cfg(r, false);
        std::thread::spawn(move || open(c))
    }));
    let mut ranks: Vec<(TcpTransport, crossbeam_channel::Receiver<Incoming>)> = starting
        .into_iter()
        .map(|h| h.join().unwrap().expect("start-up"))
        .collect();
    let recv = |rx: &crossbeam_channel::Receiver<Incoming>| {
        rx.recv_timeout(Duration::from_secs(10))
            .expect("a delivery")
            .map(|d| d.env)
    };
    // While rank 2 is alive, nobody may take its place.
    let e = open(cfg(2, true))
        .err()
        .expect("a live rank cannot be replaced");
    assert!(e.to_string().contains("alive"), "{e}");
    // ...and the living rank keeps its connection: messages still flow both ways.
    ranks[0].0.send(2, note(0, 5)).unwrap();
    assert_eq!(
        recv(&ranks[2].1)
            .expect("rank 2 still hears rank 0")
            .tag
            .seq,
        5
    );
    ranks[2].0.send(0, note(2, 6)).unwrap();
    assert_eq!(
        recv(&ranks[0].1)
            .expect("rank 0 still hears rank 2")
            .tag
            .seq,
        6
    );
    // Rank 2 goes away; its peers see the connection close.
    drop(ranks.pop());
    for (_, rx) in &ranks {
        assert!(matches!(recv(rx), Err(l) if l.peer == 2));
    }
    // Rank 0 serves the rendezvous and cannot be the one that rejoins.
    assert!(open(cfg(0, true)).is_err());
    // A rejoin whose registered address is not where its connection comes from (it listens
    // on 127.0.0.2 and calls from 127.0.0.1) is refused.
    let mut elsewhere = cfg(2, true);
    elsewhere.bind = Some(std::net::Ipv4Addr::new(127, 0, 0, 2).into());
    let e = open(elsewhere)
        .err()
        .expect("an address that is not the caller's is refused");
    assert!(e.to_string().contains("but calls from 127.0.0.1"), "{e}");
    // A new process takes over rank 2: messages flow both ways on the new connections.
    let (mut joiner, rx2) = open(cfg(2, true)).expect("rejoin");
    for (peer, (t, rx)) in ranks.iter_mut().enumerate() {
        joiner.send(peer, note(2, 10 + peer as u64)).unwrap();
        let got = recv(rx).expect("a message from the joiner");
        assert_eq!((got.from, got.tag.seq), (2, 10 + peer as u64));
        t.send(2, note(peer, 20 + peer as u64)).unwrap();
        let back = recv(&rx2).expect("an answer to the joiner");
        assert_eq!((back.from, back.tag.seq), (peer, 20 + peer as u64));
        assert_eq!(back.data.as_slice(), &[back.tag.seq as f32; 3]);
    }
}

/// Rank 0 of `cfg`'s job, started in a thread of this process on a rendezvous bound to port
/// 0: its start-up, its inbox and the address it bound.
fn rendezvous_in_thread(
    cfg: TcpConfig,
    dir: &TempDir,
) -> (
    std::thread::JoinHandle<
        Result<wagma::transport::tcp::TcpTransport, wagma::error::TransportError>,
    >,
    crossbeam_channel::Receiver<wagma::transport::Incoming>,
    String,
) {
    let file = dir.path().join("rendezvous");
    let mut c0 = cfg;
    c0.rendezvous = "127.0.0.1:0".into();
    c0.rendezvous_file = Some(file.clone());
    let (tx, rx) = crossbeam_channel::unbounded();
    let rank0 = std::thread::spawn(move || wagma::transport::tcp::connect(&c0, tx));
    let rdv = await_rendezvous(&file, || None);
    (rank0, rx, rdv)
}

#[test]
fn a_rank_that_never_starts_is_named_by_rank_0_and_awaited_by_the_others() {
    let cred = job_credentials("absent");
    // Rank 1 gives up long before rank 0 does: it is still waiting for the address table.
    let config = |rank: usize, rdv: &str| {
        let mut c = TcpConfig::new(rank, 3, rdv, cred.clone());
        c.connect_timeout = Duration::from_secs(if rank == 0 { 8 } else { 2 });
        c
    };
    let dir = TempDir::new("tcp-absent");
    let (rank0, _rx0, rdv) = rendezvous_in_thread(config(0, ""), &dir);
    let (tx, _rx1) = crossbeam_channel::unbounded();
    // Rank 1 registers; rank 2 never starts.
    let one = wagma::transport::tcp::connect(&config(1, &rdv), tx)
        .err()
        .expect("rank 1 cannot start without rank 2")
        .to_string();
    let zero = rank0
        .join()
        .unwrap()
        .err()
        .expect("rank 0 cannot start without rank 2")
        .to_string();
    assert!(
        one.contains("rank 1, waiting for rank 0's address table"),
        "{one}"
    );
    assert!(
        zero.contains("only 1 of 2 ranks registered") && zero.contains("rank 2 did not"),
        "{zero}"
    );
}

#[test]
fn silent_and_trickling_callers_do_not_hold_up_the_start() {
    let cred = job_credentials("patient");
    let config = |rank: usize, rdv: &str| {
        let mut c = TcpConfig::new(rank, 3, rdv, cred.clone());
        // Far longer than a correct start-up takes on any machine, far shorter than the
        // trickler below would hold a listener that served callers one at a time.
        c.connect_timeout = Duration::from_secs(60);
        c
    };
    let dir = TempDir::new("tcp-patient");
    let (rank0, _inbox, rdv) = rendezvous_in_thread(config(0, ""), &dir);
    // A few callers that connect and say nothing, and one that sends a byte every 500 ms
    // for 120 s: each read it makes succeeds, so only a whole-handshake deadline ends it.
    let silent: Vec<_> = (0..5)
        .map(|_| std::net::TcpStream::connect(&rdv).unwrap())
        .collect();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickler = {
        let (rdv, stop) = (rdv.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(&rdv).unwrap();
            for _ in 0..240 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) || s.write_all(&[1]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let others: Vec<_> = (1..3)
        .map(|r| {
            let c = config(r, &rdv);
            std::thread::spawn(move || {
                let (tx, _rx) = crossbeam_channel::unbounded();
                wagma::transport::tcp::connect(&c, tx).map(|_| ())
            })
        })
        .collect();
    for h in others {
        h.join()
            .unwrap()
            .expect("a rank joins past the silent callers");
    }
    rank0
        .join()
        .unwrap()
        .expect("rank 0 starts past the silent callers");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickler.join().unwrap();
    drop(silent);
}

#[test]
fn an_empty_secret_beyond_loopback_is_refused() {
    // Listening on the unspecified address is beyond loopback.
    let mut cfg = TcpConfig::new(
        0,
        2,
        "127.0.0.1:0",
        Credentials {
            job_id: "open".into(),
            secret: Vec::new(),
        },
    );
    cfg.bind = Some(std::net::Ipv4Addr::UNSPECIFIED.into());
    cfg.connect_timeout = Duration::from_secs(5);
    let (tx, _rx) = crossbeam_channel::unbounded();
    let e = wagma::transport::tcp::connect(&cfg, tx)
        .err()
        .expect("no secret beyond loopback");
    assert!(e.to_string().contains(env::ALLOW_EMPTY_SECRET), "{e}");
}

#[test]
fn a_secret_file_others_can_read_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("tcp-secret-file");
    let f = dir.path().join("secret");
    std::fs::write(&f, "  s3cret\n").unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = wagma::transport::tcp::read_secret_file(&f).unwrap_err();
    assert!(e.to_string().contains("chmod 600"), "{e}");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        wagma::transport::tcp::read_secret_file(&f).unwrap(),
        b"s3cret"
    );
}

/// The credentials of a test job named `name` (its secret derived from the name).
fn job_credentials(name: &str) -> Credentials {
    Credentials {
        job_id: name.into(),
        secret: format!("{name}-secret").into_bytes(),
    }
}

/// Each rank's transport and inbox.
type InProcessJob = Vec<(
    wagma::transport::tcp::TcpTransport,
    crossbeam_channel::Receiver<wagma::transport::Incoming>,
)>;

/// A job of `p` ranks in this process (one start-up thread each), each configured by `tweak`.
fn ranks_in_threads(name: &str, p: usize, tweak: impl Fn(&mut TcpConfig)) -> InProcessJob {
    let cred = job_credentials(name);
    let config = |rank: usize, rdv: &str| {
        let mut c = TcpConfig::new(rank, p, rdv, cred.clone());
        c.connect_timeout = Duration::from_secs(60);
        tweak(&mut c);
        c
    };
    let dir = TempDir::new(&format!("tcp-{name}"));
    let (rank0, rx0, rdv) = rendezvous_in_thread(config(0, ""), &dir);
    let others: Vec<_> = (1..p)
        .map(|rank| {
            let cfg = config(rank, &rdv);
            std::thread::spawn(move || {
                let (tx, rx) = crossbeam_channel::unbounded();
                wagma::transport::tcp::connect(&cfg, tx).map(|t| (t, rx))
            })
        })
        .collect();
    let mut job = vec![(rank0.join().unwrap().unwrap(), rx0)];
    job.extend(others.into_iter().map(|h| h.join().unwrap().unwrap()));
    job
}

/// A job of two ranks in this process, each configured by `tweak`: rank 0's transport and
/// inbox, and rank 1's transport.
fn two_ranks(
    name: &str,
    tweak: impl Fn(&mut TcpConfig),
) -> (
    wagma::transport::tcp::TcpTransport,
    crossbeam_channel::Receiver<wagma::transport::Incoming>,
    wagma::transport::tcp::TcpTransport,
) {
    let mut job = ranks_in_threads(name, 2, tweak).into_iter();
    let (t0, rx0) = job.next().expect("rank 0");
    let (t1, _rx1) = job.next().expect("rank 1");
    (t0, rx0, t1)
}

#[test]
fn a_virtual_payload_from_a_peer_ends_the_connection() {
    use wagma::transport::Transport;
    let (_t0, rx0, mut t1) = two_ranks("virtual", |_| {});
    // A length without values would turn the receiver's sums into no-ops. The sender refuses
    // to send one; written anyway, the receiver refuses it.
    let mut env = note(1, 3);
    env.data = Payload::Size(3);
    assert!(t1.send(0, env.clone()).is_err());
    let mut bytes = Vec::new();
    wagma::transport::frame::write_frame(&mut bytes, &env, 1 << 20).unwrap();
    t1.inject_raw(0, &bytes).unwrap();
    let lost = rx0
        .recv_timeout(Duration::from_secs(30))
        .expect("a delivery")
        .expect_err("the connection is reported lost");
    assert_eq!(lost.peer, 1);
    assert!(lost.reason.contains("virtual payload"), "{}", lost.reason);
}

#[test]
fn tagged_frames_arrive_and_an_altered_one_ends_the_connection() {
    use wagma::transport::Transport;
    let (_t0, rx0, mut t1) = two_ranks("tagged", |c| c.frame_integrity = true);
    let recv = || {
        rx0.recv_timeout(Duration::from_secs(10))
            .expect("a delivery")
            .map(|d| d.env)
    };
    for seq in 0..3 {
        t1.send(0, note(1, seq)).unwrap();
        let got = recv().expect("a tagged frame");
        assert_eq!((got.from, got.tag.seq), (1, seq));
    }
    // A frame whose bytes were changed after tagging (here: an untagged frame) is refused.
    let mut untagged = Vec::new();
    wagma::transport::frame::write_frame(&mut untagged, &note(1, 9), 1 << 20).unwrap();
    untagged.extend_from_slice(&[0u8; 32]);
    t1.inject_raw(0, &untagged).unwrap();
    let lost = recv().expect_err("the connection is reported lost");
    assert_eq!(lost.peer, 1);
    assert!(lost.reason.contains("integrity"), "{}", lost.reason);
}

#[test]
fn ranks_registered_before_a_start_up_fails_learn_why() {
    let cred = job_credentials("told");
    let config = |rank: usize, rdv: &str, tags: bool| {
        let mut c = TcpConfig::new(rank, 3, rdv, cred.clone());
        c.connect_timeout = Duration::from_secs(10);
        c.frame_integrity = tags;
        c
    };
    // Rank 1 registers, then rank 2 arrives framing otherwise: rank 0 cannot start the job and
    // says why to rank 1, which would otherwise see only rank 0 going away. Rank 2 waits a
    // little so that rank 1 is registered first; should it still come first (a very loaded
    // machine), rank 1 was never registered, and the scenario runs again with a longer wait.
    let mut last = String::new();
    for attempt in 0..6u32 {
        let dir = TempDir::new(&format!("tcp-told-{attempt}"));
        let (rank0, _rx0, rdv) = rendezvous_in_thread(config(0, "", true), &dir);
        let rank1 = {
            let c = config(1, &rdv, true);
            std::thread::spawn(move || {
                let (tx, _rx) = crossbeam_channel::unbounded();
                wagma::transport::tcp::connect(&c, tx)
                    .err()
                    .map(|e| e.to_string())
            })
        };
        std::thread::sleep(Duration::from_millis(200 << attempt));
        let (tx2, _rx2) = crossbeam_channel::unbounded();
        let e2 = wagma::transport::tcp::connect(&config(2, &rdv, false), tx2)
            .err()
            .expect("rank 2 frames otherwise than rank 0");
        assert!(e2.to_string().contains("integrity"), "{e2}");
        assert!(rank0.join().unwrap().is_err());
        let e1 = rank1
            .join()
            .unwrap()
            .expect("rank 1 cannot start without rank 2");
        if !e1.contains("refused") {
            last = e1;
            continue;
        }
        assert!(
            e1.contains("start-up failed")
                && e1.contains("rank 2 at 127.0.0.1:")
                && e1.contains("frames without integrity tags and rank 0 with"),
            "{e1}"
        );
        return;
    }
    panic!("rank 1 was never told why the start-up failed (last: {last})");
}

#[test]
fn ranks_that_disagree_on_frame_integrity_fail_to_start_naming_it() {
    let cred = job_credentials("disagree");
    let limit = Duration::from_secs(10);
    let config = |rank: usize, rdv: &str, tags: bool| {
        let mut c = TcpConfig::new(rank, 2, rdv, cred.clone());
        c.connect_timeout = limit;
        c.frame_integrity = tags;
        c
    };
    let dir = TempDir::new("tcp-disagree");
    let started = Instant::now();
    let (rank0, _rx0, rdv) = rendezvous_in_thread(config(0, "", true), &dir);
    let (tx1, _rx1) = crossbeam_channel::unbounded();
    let e1 = wagma::transport::tcp::connect(&config(1, &rdv, false), tx1)
        .err()
        .expect("rank 1 frames otherwise than rank 0")
        .to_string();
    let e0 = rank0
        .join()
        .unwrap()
        .err()
        .expect("rank 0 frames otherwise than rank 1")
        .to_string();
    // At once, not at the connect timeout (which would name no setting).
    assert!(started.elapsed() < limit, "{:?}", started.elapsed());
    assert!(
        e1.contains("rank 0 frames with integrity tags and rank 1 without"),
        "{e1}"
    );
    assert!(
        e0.contains("rank 1 at 127.0.0.1:")
            && e0.contains("frames without integrity tags and rank 0 with"),
        "{e0}"
    );
    for e in [&e0, &e1] {
        assert!(e.contains(env::FRAME_INTEGRITY), "{e}");
    }
}

#[test]
fn a_peer_that_floods_the_inbox_is_reported_lost() {
    use wagma::transport::{MAX_QUEUED_PER_PEER, Transport};
    let (t0, rx0, mut t1) = two_ranks("flood", |_| {});
    let recv = || {
        rx0.recv_timeout(Duration::from_secs(30))
            .expect("a delivery")
            .map(|d| d.env)
    };
    // An engine that takes what arrives keeps the queue short, however much comes.
    let n = 2 * MAX_QUEUED_PER_PEER as u64;
    for seq in 0..n {
        t1.send(0, note(1, seq)).unwrap();
        let got = recv().expect("a message");
        assert_eq!(got.tag.seq, seq);
        t0.taken(got.from);
    }
    // One that takes nothing: the reader stops at the bound and reports the peer lost.
    for seq in 0..=MAX_QUEUED_PER_PEER as u64 {
        t1.send(0, note(1, n + seq)).unwrap();
    }
    for seq in 0..MAX_QUEUED_PER_PEER as u64 {
        assert_eq!(recv().expect("a message").tag.seq, n + seq);
    }
    let lost = recv().expect_err("the flooder is reported lost");
    assert_eq!(lost.peer, 1);
    assert!(lost.reason.contains("has not taken in"), "{}", lost.reason);
}

#[test]
fn a_stalled_peer_delays_only_what_goes_to_it() {
    use wagma::transport::{Envelope, Incoming, Kind, Meta, Tag, Transport};
    let cred = job_credentials("stalled");
    let config = |rank: usize, rdv: &str| {
        let mut c = TcpConfig::new(rank, 3, rdv, cred.clone());
        c.connect_timeout = Duration::from_secs(30);
        c.io_timeout = Duration::from_secs(2);
        c
    };
    let dir = TempDir::new("tcp-stalled");
    let (rank0, _rx0, rdv) = rendezvous_in_thread(config(0, ""), &dir);
    // Rank 1's engine never takes anything: once its one-message inbox is full its reader
    // stops reading, and rank 0's connection to it fills up.
    let (tx1, rx1) = crossbeam_channel::bounded::<Incoming>(1);
    let c1 = config(1, &rdv);
    let rank1 = std::thread::spawn(move || wagma::transport::tcp::connect(&c1, tx1));
    let (tx2, rx2) = crossbeam_channel::unbounded::<Incoming>();
    let _t2 = wagma::transport::tcp::connect(&config(2, &rdv), tx2).unwrap();
    let _t1 = rank1.join().unwrap().unwrap();
    let mut t0 = rank0.join().unwrap().unwrap();
    let mut model = Payload::Data(vec![0.5; 1 << 18]);
    let frame = |seq: u64, data: Payload| Envelope {
        from: 0,
        tag: Tag {
            kind: Kind::Collective,
            seq,
            step: 0,
        },
        meta: Meta::default(),
        data,
    };
    // Queueing never blocks; once the connection has taken nothing for its I/O timeout
    // (2 s), sends to it fail. The deadline only guards against a hang.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut stalled = None;
    for seq in 0.. {
        if let Err(e) = t0.send(1, frame(seq, model.view(0..1 << 18))) {
            stalled = Some(e.to_string());
            break;
        }
        // Rank 2 is served meanwhile.
        if seq % 50 == 0 {
            t0.send(2, note(0, seq)).unwrap();
            let got = rx2
                .recv_timeout(Duration::from_secs(30))
                .expect("a delivery");
            assert_eq!(got.expect("a message").env.tag.seq, seq);
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let stalled = stalled.expect("a peer that reads nothing cannot take frames forever");
    // Found by the queue (a write stalled for the timeout) or by the socket's own timeout.
    assert!(
        stalled.contains("made no progress") || stalled.contains("writing a frame"),
        "{stalled}"
    );
    // Rank 2 still gets what rank 0 sends it.
    t0.send(2, note(0, 7)).unwrap();
    let got = rx2
        .recv_timeout(Duration::from_secs(30))
        .expect("a delivery")
        .expect("a message")
        .env;
    assert_eq!((got.from, got.tag.seq), (0, 7));
    drop(rx1);
}

#[test]
fn a_part_asked_for_is_folded_as_it_arrives_with_or_without_frame_tags() {
    use wagma::payload::{Place, Reduce};
    use wagma::transport::tcp::TcpTransport;
    use wagma::transport::{Delivery, Fold, FoldInto, Transport};
    /// `env` from rank 1 to rank 0, which asked `into` for it first (if any).
    fn exchange(
        (t0, rx0, t1): (
            &mut TcpTransport,
            &crossbeam_channel::Receiver<wagma::transport::Incoming>,
            &mut TcpTransport,
        ),
        env: wagma::transport::Envelope,
        into: Option<FoldInto>,
    ) -> Delivery {
        if let Some(into) = into {
            t0.fold(1, Fold { tag: env.tag, into });
        }
        t1.send(0, env).unwrap();
        let got = rx0
            .recv_timeout(Duration::from_secs(30))
            .expect("a delivery")
            .expect("a message");
        // As the engine's executor does: it may hold a fold only while nothing from the peer
        // waits in the inbox.
        t0.taken(1);
        got
    }
    let len = (1 << 18) + 5;
    for integrity in [false, true] {
        let name = if integrity { "fold-tagged" } else { "fold" };
        let (mut t0, rx0, mut t1) = two_ranks(name, |c| c.frame_integrity = integrity);
        assert!(t0.folds());
        let mut mine = Payload::Data(model(0, 1, len));
        let own = mine.view(0..len);
        for (seq, op) in [(1, Reduce::Sum), (2, Reduce::Max)] {
            let mut env = note(1, seq);
            env.data = Payload::Data(model(1, seq, len));
            let theirs = env.data.clone();
            // Asked for before the message is sent: the reader folds it.
            let own_part = own.downgrade().expect("a view is shared");
            let into = FoldInto::Own {
                own: own_part,
                op,
                layout: None,
            };
            let got = exchange((&mut t0, &rx0, &mut t1), env, Some(into));
            assert!(got.folded, "{name} {op:?}");
            let want = Payload::reduce_of(&own, &theirs, op);
            assert_eq!(got.env.data, want, "{name} {op:?}");
        }
        // Not asked for: it arrives as sent.
        let got = exchange((&mut t0, &rx0, &mut t1), note(1, 3), None);
        assert!(!got.folded);
        assert_eq!(got.env.data, note(1, 3).data);
        // Asked to be read into place: the same values, where the whole has them.
        let mut env = note(1, 4);
        env.data = Payload::Data(model(1, 4, len));
        let theirs = env.data.clone();
        let place = Place::new(3..3 + len, len + 5);
        let got = exchange((&mut t0, &rx0, &mut t1), env, Some(FoldInto::Place(place)));
        assert!(!got.folded);
        assert_eq!(got.env.data, theirs);
        let (v, at) = got.env.data.into_placed().expect("held by none else");
        assert_eq!((at, v.len()), (3, 3 + len));
        assert!(v.capacity() >= len + 5);
        assert_eq!(&v[3..], theirs.as_slice());
        // Folded into the first half of a buffer laid out for a whole, then the second half
        // read beside it: one buffer holds both.
        let whole = 2 * len;
        let mut env = note(1, 5);
        env.data = Payload::Data(model(1, 5, len));
        let into = FoldInto::Own {
            own: own.downgrade().expect("a view is shared"),
            op: Reduce::Sum,
            layout: Some(Place::new(0..len, whole)),
        };
        let first = exchange((&mut t0, &rx0, &mut t1), env.clone(), Some(into))
            .env
            .data;
        assert_eq!(first, Payload::reduce_of(&own, &env.data, Reduce::Sum));
        let place = first
            .place_beside(0, &(len..whole), whole)
            .expect("the rest is free");
        let mut env = note(1, 6);
        env.data = Payload::Data(model(1, 6, len));
        let theirs = env.data.clone();
        let second = exchange((&mut t0, &rx0, &mut t1), env, Some(FoldInto::Place(place)));
        assert_eq!(second.env.data, theirs);
        let beside = first.as_slice().as_ptr().wrapping_add(len);
        assert!(
            std::ptr::eq(second.env.data.as_slice().as_ptr(), beside),
            "{name}"
        );
    }
}

/// Every result of a few allreduces large enough to be folded as they arrive, as bits, and
/// how many received parts were.
async fn large_allreduces(c: &mut wagma::Comm) -> Result<(Vec<Vec<u32>>, u64), Error> {
    use wagma::schedule::{AlgorithmChoice, AllreduceAlgorithm};
    let (p, rank) = (c.size(), c.rank());
    let everyone: Vec<usize> = (0..p).collect();
    // A quarter of it (a part of reduce-scatter at P = 4) is still large enough.
    let len = (1 << 18) + 5;
    let mut bits = Vec::new();
    for (seq, algorithm) in [
        AllreduceAlgorithm::RecursiveDoubling,
        AllreduceAlgorithm::ReduceScatterAllgather,
    ]
    .into_iter()
    .enumerate()
    {
        let choice = AlgorithmChoice {
            algorithm,
            ..AlgorithmChoice::default()
        };
        let data = Payload::Data(model(rank, seq as u64, len));
        let got = c
            .allreduce_with(&everyone, seq as u64, data, 0, &choice)
            .await?;
        bits.push(got.data.as_slice().iter().map(|x| x.to_bits()).collect());
    }
    let max = c.allreduce_max(Payload::Data(model(rank, 7, len))).await?;
    bits.push(max.as_slice().iter().map(|x| x.to_bits()).collect());
    Ok((bits, c.engine_stats().await?.folded_on_arrival))
}

#[test]
fn parts_folded_as_they_arrive_give_the_in_process_bits() {
    // At P = 2 the reduce-scatter's half is also summed into a buffer laid out for the whole
    // and the allgather's half read in beside it.
    for p in [2, 4] {
        let net = ranks_in_threads(&format!("fold-job-{p}"), p, |_| {})
            .into_iter()
            .map(|(t, rx)| {
                (
                    Box::new(t) as Box<dyn wagma::transport::Transport + Send>,
                    rx,
                )
            })
            .collect();
        let tcp = threaded::run_on(net, EngineConfig::default(), large_allreduces)
            .unwrap()
            .into_all()
            .unwrap();
        let mem = threaded::run(p, EngineConfig::default(), large_allreduces)
            .unwrap()
            .into_all()
            .unwrap();
        // Whether a part is folded depends on whether it came before the phase that sums it
        // started; the bits must not.
        for (rank, ((over_tcp, _), (in_process, none))) in tcp.iter().zip(&mem).enumerate() {
            assert!(
                over_tcp == in_process,
                "P = {p}, rank {rank}: the bits differ"
            );
            assert_eq!(*none, 0, "the in-process transport folds nothing");
        }
        let folded: u64 = tcp.iter().map(|(_, f)| f).sum();
        eprintln!("P = {p}: {folded} of the received parts were folded as they arrived");
    }
}
