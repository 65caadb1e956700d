//! The engine state machine driven by hand: a FIFO network and explicit requests.

use std::collections::VecDeque;
use std::time::Duration;

use super::*;
use crate::topology::GroupingKind;

struct Net {
    engines: Vec<Engine>,
    wire: VecDeque<(Rank, Envelope)>,
    done: Vec<(Rank, ReqId, Result<Response, Error>)>,
    sent: Vec<(Rank, Rank, Kind, u64)>,
    /// (rank, peer): the rank's engine asked to drop its connection to the peer.
    disconnected: Vec<(Rank, Rank)>,
    /// Act as a transport asked to fold that only records what it is asked to, as if every
    /// message came first (else it folds what it is asked to as it delivers it).
    too_late: bool,
    /// (rank, peer, fold): asked for and not yet used.
    folds: Vec<(Rank, Rank, Fold)>,
    /// What became of the folds asked for.
    counts: FoldCounts,
}

/// What a [`Net`] did with the folds and placements it was asked for.
#[derive(Debug, Default, Clone, Copy)]
struct FoldCounts {
    /// Messages delivered folded.
    folded: usize,
    /// Folds withdrawn.
    unfolded: usize,
    /// Messages delivered read into place.
    placed: usize,
    /// Of those, read beside another part of their whole, in its buffer.
    beside: usize,
    /// Folds whose sum was laid out in a buffer for the whole.
    laid_out: usize,
    /// Folds said to come.
    expected: usize,
}

impl Net {
    fn new(p: usize) -> Net {
        Net::with_config(p, EngineConfig::default())
    }

    fn with_config(p: usize, cfg: EngineConfig) -> Net {
        Net {
            engines: (0..p).map(|r| Engine::new(r, p, cfg)).collect(),
            wire: VecDeque::new(),
            done: Vec::new(),
            sent: Vec::new(),
            disconnected: Vec::new(),
            too_late: false,
            folds: Vec::new(),
            counts: FoldCounts::default(),
        }
    }

    fn absorb(&mut self, from: Rank, out: Vec<Action>) {
        for a in out {
            match a {
                Action::Send { to, env } => {
                    self.sent.push((from, to, env.tag.kind, env.tag.seq));
                    self.wire.push_back((to, env));
                }
                Action::Complete { id, result } => self.done.push((from, id, result)),
                Action::Disconnect { peer } => self.disconnected.push((from, peer)),
            }
        }
        let requests: Vec<_> = self.engines[from].drain_fold_requests().collect();
        for request in requests {
            match request {
                // A placement is never withdrawn: one asked too late is dropped at once.
                FoldRequest::Ask {
                    fold:
                        Fold {
                            into: crate::transport::FoldInto::Place(_),
                            ..
                        },
                    ..
                } if self.too_late => {}
                FoldRequest::Ask { from: peer, fold } => self.folds.push((from, peer, fold)),
                FoldRequest::Expect { .. } => self.counts.expected += 1,
                FoldRequest::Withdraw { from: peer, tag } => {
                    let asked =
                        |(r, p, f): &(Rank, Rank, Fold)| (*r, *p, f.tag) == (from, peer, tag);
                    assert!(
                        self.folds.iter().any(asked),
                        "{from} withdrew a fold it never asked for"
                    );
                    self.folds.retain(|f| !asked(f));
                    self.counts.unfolded += 1;
                }
            }
        }
    }

    fn request(&mut self, rank: Rank, id: ReqId, req: Request) {
        let mut out = Vec::new();
        self.engines[rank].on_request(Duration::ZERO, id, req, &mut out);
        self.absorb(rank, out);
    }

    /// Delivers messages until none is left, or `limit` of them.
    fn pump(&mut self, limit: usize) {
        for _ in 0..limit {
            let Some((to, mut env)) = self.wire.pop_front() else {
                return;
            };
            let asked = self
                .folds
                .iter()
                .position(|(r, p, f)| (*r, *p, f.tag) == (to, env.from, env.tag))
                .filter(|_| !self.too_late);
            let mut out = Vec::new();
            if let Some(i) = asked {
                let (_, _, fold) = self.folds.swap_remove(i);
                match fold.into {
                    crate::transport::FoldInto::Own { own, op, layout } => {
                        let own = own.upgrade().expect("the part waits for this message");
                        env.data = match layout {
                            Some(layout) => {
                                self.counts.laid_out += 1;
                                let mut t = layout.fresh();
                                let (mine, theirs) = (own.as_slice(), env.data.as_slice());
                                op.zip_into(t.values(), mine, theirs, mine.len());
                                t.into_payload()
                            }
                            None => Payload::reduce_of(&own, &env.data, op),
                        };
                        self.counts.folded += 1;
                        self.engines[to].on_folded_message(Duration::ZERO, env, &mut out);
                    }
                    crate::transport::FoldInto::Place(place) => {
                        let mut t = place.target();
                        self.counts.beside += usize::from(t.is_claimed());
                        t.values().copy_from_slice(env.data.as_slice());
                        env.data = t.into_payload();
                        self.counts.placed += 1;
                        self.engines[to].on_message(Duration::ZERO, env, &mut out);
                    }
                }
            } else {
                self.engines[to].on_message(Duration::ZERO, env, &mut out);
            }
            self.absorb(to, out);
        }
    }

    /// The outcome of request `id` of `rank`, which must be complete.
    fn take(&mut self, rank: Rank, id: ReqId) -> Result<Response, Error> {
        let i = self
            .done
            .iter()
            .position(|(r, i, _)| *r == rank && *i == id)
            .unwrap_or_else(|| panic!("request {id} of rank {rank} is not complete"));
        self.done.remove(i).2
    }

    fn take_round(&mut self, rank: Rank, id: ReqId) -> RoundResult {
        match self.take(rank, id) {
            Ok(Response::Round(r)) => r,
            other => panic!("unexpected {other:?}"),
        }
    }
}

fn open(net: &mut Net, s: usize, len: usize) {
    open_with(net, s, ContributionMode::Model, ReadMode::Latest, |r| {
        vec![r as f32; len]
    });
}

/// Opens a solo-triggered butterfly stream of groups of `s` on every rank, with rank r's
/// initial contribution `initial(r)`.
fn open_with(
    net: &mut Net,
    s: usize,
    mode: ContributionMode,
    read: ReadMode,
    initial: impl Fn(Rank) -> Vec<f32>,
) {
    for r in 0..net.engines.len() {
        let cfg = StreamConfig {
            group_size: s,
            grouping: GroupingKind::Butterfly,
            trigger: Trigger::Solo,
            mode,
            read,
            sync_period: None,
            initial: Payload::Data(initial(r)),
            initial_steps: 0,
        };
        net.request(r, 1000, Request::OpenStream(Box::new(cfg)));
    }
    net.done.clear();
}

fn arrive(net: &mut Net, rank: Rank, round: u64, value: f32) {
    let data = Payload::Data(vec![value; 2]);
    net.request(
        rank,
        round,
        Request::Arrive {
            round,
            data,
            steps: round + 1,
        },
    );
}

#[test]
fn an_activation_reaches_the_ranks_below_a_dead_one_in_the_tree() {
    // From root 0 of 8 the tree is 0 -> 1, 2, 4; 1 -> 3, 5; 2 -> 6; 3 -> 7. With rank 1 dead,
    // rank 0 sends what 1 would have, so ranks 3, 5 and 7 still take part without arriving.
    let mut net = Net::with_config(8, elastic());
    open(&mut net, 4, 2);
    for r in (0..8).filter(|&r| r != 1) {
        let mut out = Vec::new();
        net.engines[r].on_peer_lost(Duration::ZERO, 1, "killed", &mut out);
        net.absorb(r, out);
    }
    arrive(&mut net, 0, 0, 100.0);
    net.pump(10_000);
    for e in net.engines.iter().filter(|e| e.rank != 1) {
        assert_eq!(e.stats.rounds, 1, "rank {}", e.rank);
    }
    let sent_by_0: Vec<Rank> = net
        .sent
        .iter()
        .filter(|s| s.2 == Kind::Activation && s.0 == 0)
        .map(|s| s.1)
        .collect();
    assert_eq!(sent_by_0, [3, 5, 2, 4]);
    // Group {0, 1, 2, 3} without its dead member: rank 0 fresh, 2 and 3 passive.
    assert_eq!(net.take_round(0, 0).sum.as_slice(), &[100.0 + 2.0 + 3.0; 2]);
    // Group {4, 5, 6, 7} ran with every member passive; a late arrival finds it done.
    arrive(&mut net, 4, 0, 400.0);
    let r4 = net.take_round(4, 0);
    assert!(!r4.fresh);
    assert_eq!(r4.sum.as_slice(), &[4.0 + 5.0 + 6.0 + 7.0; 2]);
}

#[test]
fn two_activators_run_the_round_once_everywhere() {
    let mut net = Net::new(8);
    open(&mut net, 4, 2);
    // Ranks 0 and 6 arrive at round 0 before any message moves.
    arrive(&mut net, 0, 0, 100.0);
    arrive(&mut net, 6, 0, 600.0);
    net.pump(10_000);
    for e in &net.engines {
        assert_eq!(e.stats.rounds, 1, "rank {}", e.rank);
    }
    // Each tree edge is sent at most once per round: at most log2(8) = 3 per rank, and the
    // two activators' trees together need more than one tree's 7 edges.
    let activations = net.sent.iter().filter(|s| s.2 == Kind::Activation).count();
    assert!((8..=24).contains(&activations), "{activations}");
    for r in 0..8 {
        let from_r = net
            .sent
            .iter()
            .filter(|s| s.2 == Kind::Activation && s.0 == r)
            .count();
        assert!(from_r <= 3, "rank {r} sent {from_r}");
    }
    let r0 = net.take_round(0, 0);
    assert!(r0.fresh);
    // Group {0,1,2,3}: rank 0 fresh, ranks 1..3 passive with their initial models.
    assert_eq!(r0.sum.as_slice(), &[100.0 + 1.0 + 2.0 + 3.0; 2]);
    let r6 = net.take_round(6, 0);
    assert_eq!(r6.sum.as_slice(), &[4.0 + 5.0 + 600.0 + 7.0; 2]);
    // A late rank arriving now gets the executed round, stale.
    arrive(&mut net, 3, 0, 300.0);
    let r3 = net.take_round(3, 0);
    assert!(!r3.fresh);
    assert_eq!(r3.own.steps, 0);
    assert_eq!(r3.sum.as_slice(), r0.sum.as_slice());
}

impl Net {
    /// Delivers, in wire order, the messages for which `pick(to, envelope)` holds, until none
    /// is left; the others stay on the wire in their order.
    fn pump_only(&mut self, pick: impl Fn(Rank, &Envelope) -> bool) {
        while let Some(i) = self.wire.iter().position(|(to, env)| pick(*to, env)) {
            let Some((to, env)) = self.wire.remove(i) else {
                return;
            };
            let mut out = Vec::new();
            self.engines[to].on_message(Duration::ZERO, env, &mut out);
            self.absorb(to, out);
        }
    }
}

#[test]
fn rounds_run_in_order_even_when_activations_overtake() {
    // P = 4, S = 2: round 0 groups {0,1},{2,3}; round 1 groups {0,2},{1,3}. The first stream's
    // sequence numbers are the round numbers.
    let mut net = Net::new(4);
    open(&mut net, 2, 2);
    arrive(&mut net, 0, 0, 1.0);
    // Ranks 0 and 1 run round 0; everything for ranks 2 and 3 is held back.
    net.pump_only(|to, _| to < 2);
    let r0 = net.take_round(0, 0);
    assert_eq!(r0.sum.as_slice(), &[2.0; 2]);
    arrive(&mut net, 0, 1, 2.0);
    net.pump_only(|to, _| to < 2);
    assert!(
        net.wire
            .iter()
            .any(|(to, env)| *to == 2 && env.tag.kind == Kind::Activation && env.tag.seq == 0),
        "round 0's activation to rank 2 is still held back"
    );
    // Round 1's messages overtake round 0's: rank 2 hears of round 1 first and must wait.
    net.pump_only(|to, env| to >= 2 && env.tag.seq == 1);
    for r in [2, 3] {
        let s = net.engines[r].stream.as_ref().unwrap();
        assert_eq!(
            (net.engines[r].stats.rounds, s.next_round()),
            (0, 0),
            "rank {r} ran a round out of order"
        );
    }
    assert!(
        net.engines[2].stream.as_ref().unwrap().is_activated(1),
        "rank 2 got round 1's activation first"
    );
    // Now the held-back round 0 arrives: rounds 0 then 1 run everywhere, once each.
    net.pump(10_000);
    for e in &net.engines {
        assert_eq!(e.stats.rounds, 2, "rank {}", e.rank);
        assert_eq!(e.stream.as_ref().unwrap().next_round(), 2);
    }
    // Rank 2 arrives at round 0 late and gets the most recent result: round 1 of group {0,2},
    // rank 0's 2.0 plus its own initial 2.0.
    arrive(&mut net, 2, 0, 5.0);
    let r = net.take_round(2, 0);
    assert_eq!((r.requested, r.round), (0, 1));
    assert_eq!(r.sum.as_slice(), &[4.0; 2]);
    assert!(!r.fresh);
}

/// Every rank arrives at every round at once, for P not a power of two: each rank sends a
/// round's activation at most once per edge (at most `ceil(log2 P)` per round), and every rank
/// runs every round exactly once with the right group.
#[test]
fn simultaneous_activators_send_each_edge_once_for_any_p() {
    for p in [5usize, 6, 7, 12] {
        let dims = usize::BITS - (p - 1).leading_zeros();
        let mut net = Net::new(p);
        let s = if p == 12 { 4 } else { 2 };
        open(&mut net, s, 2);
        let grouping = crate::topology::Grouping::new(p, s, GroupingKind::Butterfly).unwrap();
        for round in 0..4u64 {
            net.sent.clear();
            for r in 0..p {
                arrive(&mut net, r, round, 10.0 + r as f32);
            }
            net.pump(100_000);
            let activations: Vec<_> = net
                .sent
                .iter()
                .filter(|m| m.2 == Kind::Activation)
                .collect();
            assert!(activations.iter().all(|m| m.3 == round));
            for r in 0..p {
                let mut to: Vec<Rank> = activations
                    .iter()
                    .filter(|m| m.0 == r)
                    .map(|m| m.1)
                    .collect();
                assert!(
                    to.len() <= dims as usize,
                    "P={p} rank {r} sent {}",
                    to.len()
                );
                to.sort_unstable();
                assert!(
                    to.windows(2).all(|w| w[0] != w[1]),
                    "P={p} rank {r}: {to:?}"
                );
            }
            assert!(activations.len() <= p * dims as usize, "P={p}");
            for r in 0..p {
                let res = net.take_round(r, round);
                assert!(res.fresh, "P={p} rank {r} round {round}");
                let group = grouping.group_of(r, round);
                let want: f32 = group.iter().map(|&m| 10.0 + m as f32).sum();
                assert_eq!(
                    res.sum.as_slice(),
                    &[want; 2],
                    "P={p} rank {r} round {round}"
                );
                assert_eq!(net.engines[r].stats.rounds, round + 1, "P={p} rank {r}");
            }
        }
        // A single activator: everyone still runs the round once, with fewer than 2P messages.
        net.sent.clear();
        arrive(&mut net, p - 1, 4, 1.0);
        net.pump(100_000);
        let sent = net.sent.iter().filter(|m| m.2 == Kind::Activation).count();
        assert!(sent >= p - 1 && sent < 2 * p, "P={p}: {sent}");
        for e in &net.engines {
            assert_eq!(e.stats.rounds, 5, "P={p} rank {}", e.rank);
        }
    }
}

#[test]
fn activations_before_the_stream_opens_are_kept() {
    let mut net = Net::new(2);
    let cfg = |r: usize| StreamConfig {
        group_size: 2,
        grouping: GroupingKind::Butterfly,
        trigger: Trigger::Solo,
        mode: ContributionMode::Model,
        read: ReadMode::Latest,
        sync_period: None,
        initial: Payload::Data(vec![r as f32]),
        initial_steps: 0,
    };
    net.request(0, 1000, Request::OpenStream(Box::new(cfg(0))));
    net.request(
        0,
        0,
        Request::Arrive {
            round: 0,
            data: Payload::Data(vec![10.0]),
            steps: 1,
        },
    );
    // Rank 1 receives the activation and rank 0's data before opening its stream.
    net.pump(10_000);
    net.request(1, 1000, Request::OpenStream(Box::new(cfg(1))));
    net.pump(10_000);
    let r = net.take_round(0, 0);
    assert_eq!(r.sum.as_slice(), &[11.0]);
}

#[test]
fn a_timeout_names_the_missing_peer_and_stops_the_engine() {
    let mut e = Engine::new(0, 2, EngineConfig::default());
    let mut out = Vec::new();
    let schedule = crate::schedule::allreduce(0, &[0, 1], 3, &Default::default());
    e.on_request(
        Duration::ZERO,
        7,
        Request::Run(CollectiveRun {
            kind: Kind::Collective,
            seq: 0,
            schedule,
            data: Payload::Data(vec![1.0; 3]),
            weight: 0.0,
            steps: 0,
        }),
        &mut out,
    );
    assert_eq!(e.next_deadline(), Some(Duration::from_secs(60)));
    out.clear();
    e.on_tick(Duration::from_secs(61), &mut out);
    match &out[..] {
        [
            Action::Complete {
                id: 7,
                result: Err(Error::Timeout { missing, .. }),
            },
        ] => assert_eq!(missing, &vec![1]),
        other => panic!("unexpected {other:?}"),
    }
    out.clear();
    e.on_request(Duration::from_secs(62), 8, Request::Stats, &mut out);
    assert!(matches!(
        &out[..],
        [Action::Complete {
            result: Err(Error::Stopped { .. }),
            ..
        }]
    ));
}

#[test]
fn a_peer_that_said_goodbye_may_close_its_connection() {
    let mut e = Engine::new(0, 3, EngineConfig::default());
    let mut out = Vec::new();
    let bye = Engine::new(2, 3, EngineConfig::default()).farewell(false);
    let (_, env) = bye.into_iter().find(|(to, _)| *to == 0).unwrap();
    e.on_message(Duration::ZERO, env, &mut out);
    e.on_peer_lost(Duration::ZERO, 2, "connection closed", &mut out);
    assert!(e.failure().is_none());
    e.on_peer_lost(Duration::ZERO, 1, "connection reset", &mut out);
    assert!(matches!(e.failure(), Some(Error::PeerLost { peer: 1, .. })));
}

fn stats(net: &mut Net, rank: Rank) -> EngineStats {
    net.request(rank, 900, Request::Stats);
    match net.done.pop() {
        Some((_, 900, Ok(Response::Stats(s)))) => *s,
        other => panic!("unexpected {other:?}"),
    }
}

fn elastic() -> EngineConfig {
    EngineConfig {
        elastic: true,
        ..EngineConfig::default()
    }
}

/// An elastic engine of `rank` among `ranks` that announced a rejoin and waits (request 2) at
/// most `timeout` for its welcome.
fn waiting_joiner(rank: Rank, ranks: usize, timeout: Duration) -> Engine {
    let mut e = Engine::new(rank, ranks, elastic());
    let mut out = Vec::new();
    e.on_request(Duration::ZERO, 1, Request::Announce, &mut out);
    out.clear();
    e.on_request(
        Duration::ZERO,
        2,
        Request::AwaitWelcome { timeout },
        &mut out,
    );
    assert!(out.is_empty(), "nothing to send while waiting: {out:?}");
    e
}

#[test]
fn a_restarted_rank_is_admitted_welcomed_and_takes_part_in_the_next_round() {
    let cfg = elastic();
    let mut net = Net::with_config(3, cfg);
    open(&mut net, 3, 2);
    for r in 0..2 {
        let mut out = Vec::new();
        net.engines[r].on_peer_lost(Duration::ZERO, 2, "killed", &mut out);
        net.absorb(r, out);
    }
    assert_eq!(stats(&mut net, 0).dead, vec![2]);
    // Each survivor drops its connection to the dead rank, once.
    assert_eq!(net.disconnected, [(0, 2), (1, 2)]);
    // A new process takes over rank 2 and announces itself.
    net.engines[2] = Engine::new(2, 3, cfg);
    net.request(2, 1, Request::Announce);
    net.request(
        2,
        2,
        Request::AwaitWelcome {
            timeout: Duration::from_secs(60),
        },
    );
    net.pump(100);
    assert_eq!(stats(&mut net, 1).joining, vec![2]);
    // Rank 0 admits and welcomes the joiner before rank 1 gets to its admission.
    net.request(0, 3, Request::Admit { ranks: vec![2] });
    let s0 = stats(&mut net, 0);
    assert!(s0.dead.is_empty() && s0.joining.is_empty(), "{s0:?}");
    assert!(!net.done.iter().any(|(r, id, _)| *r == 2 && *id == 2));
    let welcome = Request::Welcome {
        to: 2,
        data: Payload::Data(vec![7.0; 2]),
        info: vec![40, 5],
    };
    net.request(0, 4, welcome);
    net.pump(100);
    let i = net.done.iter().position(|(r, id, _)| *r == 2 && *id == 2);
    match i.map(|i| net.done.remove(i).2) {
        Some(Ok(Response::Welcome(w))) => {
            assert_eq!(
                (w.from, w.data.as_slice(), &w.info[..]),
                (0, &[7.0, 7.0][..], &[40, 5][..])
            );
        }
        other => panic!("unexpected {other:?}"),
    }
    // The joiner is already in the collective that follows the admission when rank 1 admits it.
    let barrier = |r: Rank| {
        Request::Run(CollectiveRun {
            kind: Kind::Collective,
            seq: 43,
            schedule: crate::schedule::exchange_among(r, 0..3, 1),
            data: Payload::Data(vec![r as f32 + 1.0]),
            weight: 0.0,
            steps: 0,
        })
    };
    net.request(2, 6, barrier(2));
    net.pump(100);
    net.request(1, 3, Request::Admit { ranks: vec![2] });
    for r in 0..2 {
        net.request(r, 6, barrier(r));
    }
    net.pump(100);
    for r in 0..3 {
        let i = net.done.iter().position(|(q, id, _)| *q == r && *id == 6);
        match i.map(|i| net.done.remove(i).2) {
            Some(Ok(Response::Data { data, .. })) => {
                assert_eq!(data.as_slice(), &[6.0], "rank {r}")
            }
            other => panic!("rank {r}: unexpected {other:?}"),
        }
    }
    // An announcement that arrives after the admission changes nothing.
    let late = net.engines[2].control(join::CONTROL_JOIN, Meta::default(), Payload::Size(0));
    net.wire.push_back((1, late));
    net.pump(100);
    let s1 = stats(&mut net, 1);
    assert!(s1.dead.is_empty() && s1.joining.is_empty(), "{s1:?}");
    // The joiner opens the stream its peers have open; round 0 includes it.
    let cfg2 = StreamConfig {
        group_size: 3,
        grouping: GroupingKind::Butterfly,
        trigger: Trigger::Solo,
        mode: ContributionMode::Model,
        read: ReadMode::Latest,
        sync_period: None,
        initial: Payload::Data(vec![7.0; 2]),
        initial_steps: 0,
    };
    net.request(2, 5, Request::OpenStream(Box::new(cfg2)));
    for r in 0..3 {
        arrive(&mut net, r, 0, [1.0, 2.0, 4.0][r]);
    }
    net.pump(1000);
    for r in 0..3 {
        let res = net.take_round(r, 0);
        assert_eq!(res.sum.as_slice(), &[7.0, 7.0], "rank {r}");
        assert_eq!(res.members.len(), 3, "rank {r}");
    }
}

#[test]
fn a_joiner_that_is_never_welcomed_times_out() {
    let mut e = waiting_joiner(1, 2, Duration::from_secs(30));
    let mut out = Vec::new();
    assert_eq!(e.next_deadline(), Some(Duration::from_secs(30)));
    e.on_tick(Duration::from_secs(31), &mut out);
    match &out[..] {
        [
            Action::Complete {
                id: 2,
                result: Err(Error::Timeout { waited, .. }),
            },
        ] => assert_eq!(*waited, Duration::from_secs(31)),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_joiner_stops_waiting_when_every_peer_has_left() {
    let mut e = waiting_joiner(2, 3, Duration::from_secs(600));
    let mut out = Vec::new();
    for p in 0..2 {
        let bye = Engine::new(p, 3, elastic()).farewell(false);
        let (_, env) = bye.into_iter().find(|(to, _)| *to == 2).unwrap();
        e.on_message(Duration::from_secs(1), env, &mut out);
        e.on_tick(Duration::from_secs(1), &mut out);
        assert_eq!(out.is_empty(), p == 0, "after rank {p} left");
    }
    match &out[..] {
        [
            Action::Complete {
                id: 2,
                result: Err(Error::PeerLost { reason, .. }),
            },
        ] => assert!(reason.contains("every peer"), "{reason}"),
        other => panic!("unexpected {other:?}"),
    }
}

/// Rank 0 of 2 after rank 1 sent one message of `kind` more than [`MAX_KEPT_PER_PEER`], each
/// of its own sequence number (as `msg` builds them); checks that rank 1 was declared lost
/// with a reason containing `says`, and returns the engine.
fn flooded(msg: impl Fn(u64) -> Envelope, says: &str) -> Engine {
    let mut e = Engine::new(0, 2, EngineConfig::default());
    let mut out = Vec::new();
    for seq in 0..=MAX_KEPT_PER_PEER as u64 {
        e.on_message(Duration::ZERO, msg(seq), &mut out);
    }
    match e.failed.as_deref() {
        Some(Error::PeerLost {
            peer: 1, reason, ..
        }) => assert!(reason.contains(says), "{reason}"),
        other => panic!("{other:?}"),
    }
    e
}

/// A one-element message of `kind` and `seq` from rank 1.
fn from_rank_1(kind: Kind, seq: u64) -> Envelope {
    Envelope {
        from: 1,
        tag: Tag { kind, seq, step: 0 },
        meta: Meta::default(),
        data: Payload::Data(vec![1.0]),
    }
}

#[test]
fn a_peer_that_floods_unexpected_messages_is_lost_not_stored() {
    let e = flooded(
        |seq| from_rank_1(Kind::Exchange, seq),
        "no operation expects",
    );
    assert!(e.unexpected.len() <= MAX_KEPT_PER_PEER);
}

/// A message of rank `from` for step 0 of collective `seq` over one element, reporting
/// `contributions`.
fn contribution_msg(from: Rank, seq: u64, contributions: &[Rank]) -> Envelope {
    Envelope {
        from,
        tag: Tag {
            kind: Kind::Collective,
            seq,
            step: 0,
        },
        meta: Meta {
            total_len: 1,
            contributions: contributions
                .iter()
                .map(|&rank| Contribution { rank, steps: 1 })
                .collect(),
            ..Meta::default()
        },
        data: Payload::Data(vec![5.0]),
    }
}

/// An elastic engine of rank 0 among 2 (contribution lists are tracked) running a sum with
/// rank 1, answered by `reply`: the outcome of request 1.
fn sum_with_rank_1(reply: Envelope) -> Result<Response, Error> {
    let mut e = Engine::new(0, 2, elastic());
    let mut out = Vec::new();
    let run = Request::Run(CollectiveRun {
        kind: Kind::Collective,
        seq: 7,
        schedule: crate::schedule::exchange_among(0, [0, 1], 1),
        data: Payload::Data(vec![1.0]),
        weight: 0.0,
        steps: 1,
    });
    e.on_request(Duration::ZERO, 1, run, &mut out);
    e.on_message(Duration::ZERO, reply, &mut out);
    out.into_iter()
        .find_map(|a| match a {
            Action::Complete { id: 1, result } => Some(result),
            _ => None,
        })
        .unwrap_or_else(|| panic!("request 1 not completed"))
}

#[test]
fn contribution_lists_naming_ranks_outside_the_job_or_twice_are_refused() {
    // The honest answer: the sum and both members.
    match sum_with_rank_1(contribution_msg(1, 7, &[1])) {
        Ok(Response::Data {
            data,
            contributions,
            ..
        }) => {
            assert_eq!(data.as_slice(), &[6.0]);
            let ranks: Vec<Rank> = contributions.iter().map(|c| c.rank).collect();
            assert_eq!(ranks, [0, 1]);
        }
        other => panic!("{other:?}"),
    }
    // Rank 1 claims a rank the job does not have (which would make the divisor 3), or counts
    // itself twice: a typed error, never a sum averaged over the wrong count.
    for (lie, says) in [
        (&[1, 2][..], "not among the members"),
        (&[1, 1], "ascending"),
    ] {
        match sum_with_rank_1(contribution_msg(1, 7, lie)) {
            Err(Error::Protocol { detail, .. }) => assert!(detail.contains(says), "{detail}"),
            other => panic!("{lie:?}: {other:?}"),
        }
    }
}

#[test]
fn a_group_round_refuses_contributions_from_outside_the_group() {
    let mut net = Net::new(8);
    open(&mut net, 4, 2);
    arrive(&mut net, 0, 0, 100.0);
    // Rank 0's group in round 0 is {0, 1, 2, 3}; every message reaching it claims rank 5 too.
    while let Some((to, mut env)) = net.wire.pop_front() {
        if to == 0 && env.tag.kind == Kind::Round {
            let mut list = env.meta.contributions.to_vec();
            list.push(Contribution { rank: 5, steps: 1 });
            list.sort_by_key(|c| c.rank);
            env.meta.contributions = list.into();
        }
        let mut out = Vec::new();
        net.engines[to].on_message(Duration::ZERO, env, &mut out);
        net.absorb(to, out);
    }
    let (_, _, result) = net
        .done
        .iter()
        .find(|(r, id, _)| *r == 0 && *id == 0)
        .expect("rank 0's round completes");
    match result {
        Err(Error::Protocol { detail, .. }) => {
            assert!(
                detail.contains("rank 5 is not among the members [0, 1, 2, 3]"),
                "{detail}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn messages_of_a_dead_peer_are_dropped_until_it_announces_a_rejoin() {
    let mut e = Engine::new(0, 4, elastic());
    let mut out = Vec::new();
    e.on_peer_lost(Duration::ZERO, 3, "killed", &mut out);
    assert_eq!(e.dead(), [3]);
    // Its old incarnation's messages, still in flight, are neither kept nor counted.
    for seq in 0..5 {
        e.on_message(Duration::ZERO, contribution_msg(3, seq, &[3]), &mut out);
    }
    assert!(e.unexpected.is_empty());
    assert_eq!(e.stats.dropped_from_dead, 5);
    // Its replacement announces itself first; what it sends next is kept for the collective
    // that will admit it.
    let join =
        Engine::new(3, 4, elastic()).control(join::CONTROL_JOIN, Meta::default(), Payload::Size(0));
    e.on_message(Duration::ZERO, join, &mut out);
    e.on_message(Duration::ZERO, contribution_msg(3, 9, &[3]), &mut out);
    assert_eq!(e.unexpected.len(), 1);
    assert_eq!(e.stats.dropped_from_dead, 5);
    assert!(e.failed.is_none());
}

#[test]
fn a_flood_of_activations_for_unopened_streams_is_lost_not_stored() {
    // Repeats of one round are kept once.
    let mut e = Engine::new(0, 2, EngineConfig::default());
    for _ in 0..10 {
        let env = activation(1, stream::stream_seq(1, 0));
        e.on_message(Duration::ZERO, env, &mut Vec::new());
    }
    assert_eq!(e.early_activations.len(), 1);
    let e = flooded(
        |round| activation(1, stream::stream_seq(1, round)),
        "not opened",
    );
    assert!(e.early_activations.len() <= MAX_KEPT_PER_PEER);
}

#[test]
fn a_flood_of_averaging_requests_before_the_rank_is_passive_is_lost_not_stored() {
    let e = flooded(|seq| from_rank_1(Kind::Pair, seq), "averaging requests");
    assert!(e.early_pairs.len() <= MAX_KEPT_PER_PEER);
}

/// An activation of round `seq` rooted at `from`, as `from` sends it.
fn activation(from: Rank, seq: u64) -> Envelope {
    Envelope {
        from,
        tag: Tag {
            kind: Kind::Activation,
            seq,
            step: 0,
        },
        meta: Meta {
            aux: from as u64,
            ..Meta::default()
        },
        data: Payload::Size(0),
    }
}

/// Rank 0 of 3 in elastic mode (heartbeats every 1 s, timeout 10 s), running request 1: an
/// exchange among all three of one element, started at time 0.
fn elastic_exchange_of_three() -> (Engine, Vec<Action>) {
    let mut e = Engine::new(0, 3, elastic_with_heartbeats());
    let mut out = Vec::new();
    let run = Request::Run(CollectiveRun {
        kind: Kind::Collective,
        seq: 7,
        schedule: crate::schedule::exchange_among(0, [0, 1, 2], 1),
        data: Payload::Data(vec![1.0]),
        weight: 0.0,
        steps: 1,
    });
    e.on_request(Duration::ZERO, 1, run, &mut out);
    (e, out)
}

fn elastic_with_heartbeats() -> EngineConfig {
    EngineConfig {
        heartbeat: Some(Duration::from_secs(1)),
        timeout: Duration::from_secs(10),
        ..elastic()
    }
}

/// A heartbeat of rank `from` of 3.
fn heartbeat(from: Rank) -> Envelope {
    Engine::new(from, 3, elastic_with_heartbeats()).control(
        liveness::CONTROL_HEARTBEAT,
        Meta::default(),
        Payload::Size(0),
    )
}

#[test]
fn an_elastic_operation_gives_up_on_a_silent_peer_at_its_first_timeout() {
    let (mut e, mut out) = elastic_exchange_of_three();
    // Rank 1 delivers and goes on beating; rank 2's heartbeats stop at 6 s (a partition that
    // began during the operation), so at 10 s it is not yet silent for a timeout.
    e.on_message(Duration::ZERO, contribution_msg(1, 7, &[1]), &mut out);
    for t in 1..10 {
        e.on_message(Duration::from_secs(t), heartbeat(1), &mut out);
        if t <= 6 {
            e.on_message(Duration::from_secs(t), heartbeat(2), &mut out);
        }
        e.on_tick(Duration::from_secs(t), &mut out);
    }
    assert!(e.dead().is_empty());
    e.on_tick(Duration::from_secs(10), &mut out);
    assert_eq!(e.dead(), [2]);
    assert!(out.iter().any(|a| matches!(
        a,
        Action::Complete {
            id: 1,
            result: Ok(_)
        }
    )));
}

#[test]
fn an_elastic_operation_that_times_out_continues_without_the_peers_it_waits_for() {
    let (mut e, mut out) = elastic_exchange_of_three();
    e.on_message(Duration::ZERO, contribution_msg(1, 7, &[1]), &mut out);
    // Rank 2's heartbeats keep coming (its data does not: a peer held up elsewhere), so
    // liveness never gives up on it; the operation waits for it three timeouts in all, since
    // a late peer that is alive must not be declared dead at the first timeout.
    for t in 1..30 {
        e.on_message(Duration::from_secs(t), heartbeat(1), &mut out);
        e.on_message(Duration::from_secs(t), heartbeat(2), &mut out);
        e.on_tick(Duration::from_secs(t), &mut out);
        assert!(e.dead().is_empty(), "t = {t}");
    }
    assert!(
        !out.iter()
            .any(|a| matches!(a, Action::Complete { id: 1, .. }))
    );
    e.on_tick(Duration::from_secs(30), &mut out);
    assert_eq!(e.dead(), [2]);
    match out.into_iter().find_map(|a| match a {
        Action::Complete { id: 1, result } => Some(result),
        _ => None,
    }) {
        Some(Ok(Response::Data { data, .. })) => assert_eq!(data.as_slice(), &[6.0]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gradient_that_arrives_while_its_round_runs_is_dropped_not_taken_by_the_next_round() {
    // Eager-SGD dropping late gradients, 2 ranks. Rank 1 publishes g1 while its round 0 runs
    // without it, and round 1's activation reaches it before round 0 completes there: g1 must
    // be dropped, not contributed to round 1.
    let mut net = Net::new(2);
    open_with(
        &mut net,
        2,
        ContributionMode::DropLate,
        ReadMode::Exact,
        |_| vec![0.0; 2],
    );
    let deliver = |net: &mut Net, to: Rank, kind: Kind| {
        let i = net
            .wire
            .iter()
            .position(|(t, e)| *t == to && e.tag.kind == kind)
            .unwrap_or_else(|| panic!("no {kind:?} message for rank {to}"));
        let (to, env) = net.wire.remove(i).expect("found above");
        let mut out = Vec::new();
        net.engines[to].on_message(Duration::ZERO, env, &mut out);
        net.absorb(to, out);
    };
    arrive(&mut net, 0, 0, 1.0);
    deliver(&mut net, 1, Kind::Activation); // rank 1 runs round 0 with its zeros
    arrive(&mut net, 1, 0, 100.0); // g1: too late for round 0
    deliver(&mut net, 0, Kind::Round); // round 0 completes at rank 0
    assert_eq!(net.take_round(0, 0).sum.as_slice(), &[1.0, 1.0]);
    arrive(&mut net, 0, 1, 2.0); // rank 0 starts round 1
    deliver(&mut net, 1, Kind::Activation); // round 1 waits at rank 1 behind round 0
    deliver(&mut net, 1, Kind::Round); // round 0 completes at rank 1; round 1 starts
    let r0 = net.take_round(1, 0);
    assert!(!r0.fresh);
    assert_eq!(r0.sum.as_slice(), &[1.0, 1.0]);
    net.pump(100);
    arrive(&mut net, 1, 1, 200.0);
    net.pump(100);
    for rank in 0..2 {
        let r1 = net.take_round(rank, 1);
        assert_eq!(
            r1.sum.as_slice(),
            &[2.0, 2.0],
            "rank {rank}: g1 was not dropped"
        );
    }
}

fn mixed(net: &mut Net, rank: Rank, id: ReqId) -> Vec<f32> {
    match net.take(rank, id) {
        Ok(Response::Mixed(m)) => m.into_vec(),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_gossip_exchange_keeps_what_the_step_mixed_in_and_holds_back_a_collective() {
    let mut net = Net::new(2);
    for (r, v) in [(0, 0.0), (1, 4.0)] {
        let initial = Payload::Data(vec![v; 2]);
        net.request(
            r,
            1,
            Request::OpenGossip {
                initial,
                exchanges: 1,
            },
        );
    }
    let mix = |v: f32, start| Request::GossipMix {
        data: Payload::Data(vec![v; 2]),
        start,
    };
    // Rank 0 (active) mixes and starts an exchange that sends its shared copy [1, 1].
    net.request(0, 2, mix(2.0, true));
    assert_eq!(mixed(&mut net, 0, 2), vec![1.0; 2]);
    assert_eq!(net.wire.len(), 1);
    // It mixes again before the reply: its copy becomes [2, 2].
    net.request(0, 3, mix(3.0, true));
    assert_eq!(mixed(&mut net, 0, 3), vec![2.0; 2]);
    // A collective waits for the exchange in flight: nothing more is sent yet.
    let barrier = |r: Rank| {
        Request::Run(CollectiveRun {
            kind: Kind::Collective,
            seq: 9,
            schedule: crate::schedule::exchange_among(r, 0..2, 1),
            data: Payload::Data(vec![1.0]),
            weight: 0.0,
            steps: 0,
        })
    };
    net.request(0, 4, barrier(0));
    assert_eq!(net.wire.len(), 1);
    net.request(1, 4, barrier(1));
    net.pump(100);
    // The passive copy took the pair's average (1 + 4) / 2; the active one that average plus
    // what the second mix added: 2 + (2.5 - 1). The ended budget started nothing more.
    for r in 0..2 {
        assert!(
            net.done
                .iter()
                .any(|(rank, id, res)| *rank == r && *id == 4 && res.is_ok()),
            "rank {r}'s collective did not complete"
        );
    }
    let exchanges: Vec<u64> = (0..2)
        .map(|r| stats(&mut net, r).gossip_exchanges)
        .collect();
    assert_eq!(exchanges, vec![1, 0]);
    net.request(0, 5, mix(3.5, false));
    assert_eq!(mixed(&mut net, 0, 5), vec![3.5; 2]);
    net.request(1, 5, mix(2.5, false));
    assert_eq!(mixed(&mut net, 1, 5), vec![2.5; 2]);
    assert!(net.wire.is_empty());
    // A rank that does not gossip says so.
    let mut lone = Net::new(2);
    lone.request(0, 1, mix(1.0, true));
    assert!(matches!(
        lone.done.pop(),
        Some((0, 1, Err(Error::Protocol { .. })))
    ));
}

#[test]
fn a_collective_held_behind_a_gossip_exchange_fails_with_the_exchange() {
    // Rank 0 (active) starts an exchange with rank 1, which never answers (it died), then asks
    // for a collective, held back behind the exchange: when the exchange times out, the
    // collective is answered with that timeout, naming rank 1, not left waiting for ever.
    let mut net = Net::new(2);
    for r in 0..2 {
        let initial = Payload::Data(vec![r as f32; 2]);
        net.request(
            r,
            1,
            Request::OpenGossip {
                initial,
                exchanges: 1,
            },
        );
    }
    let mix = Request::GossipMix {
        data: Payload::Data(vec![2.0; 2]),
        start: true,
    };
    net.request(0, 2, mix);
    mixed(&mut net, 0, 2);
    assert_eq!(net.wire.len(), 1);
    net.wire.clear();
    let barrier = Request::Run(CollectiveRun {
        kind: Kind::Collective,
        seq: 9,
        schedule: crate::schedule::exchange_among(0, 0..2, 1),
        data: Payload::Data(vec![1.0]),
        weight: 0.0,
        steps: 0,
    });
    net.request(0, 3, barrier);
    assert!(
        net.wire.is_empty(),
        "the collective must wait for the exchange"
    );
    assert!(!net.done.iter().any(|(r, id, _)| (*r, *id) == (0, 3)));
    let mut out = Vec::new();
    net.engines[0].on_tick(Duration::from_secs(61), &mut out);
    net.absorb(0, out);
    match net.take(0, 3) {
        Err(Error::Timeout {
            rank: 0, missing, ..
        }) => assert_eq!(missing, vec![1]),
        other => panic!("unexpected {other:?}"),
    }
    assert!(
        net.wire.is_empty(),
        "a failed engine starts nothing held back"
    );
}

#[test]
fn a_collective_whose_schedule_the_rank_cannot_run_is_refused_before_it_starts() {
    // Rank 0 of 4 with a buffer of 3: a peer beyond the job, the rank itself as a peer and a
    // range past the buffer are refused at once; nothing is sent and the engine goes on.
    let mut e = Engine::new(0, 4, EngineConfig::default());
    let run = |schedule: Schedule| {
        Request::Run(CollectiveRun {
            kind: Kind::Exchange,
            seq: 0,
            schedule,
            data: Payload::Data(vec![1.0; 3]),
            weight: 0.0,
            steps: 0,
        })
    };
    let mut past = crate::schedule::pair_request(2, 3);
    past.phases[1].recvs[0].range = 0..4;
    let bad = [
        (crate::schedule::exchange(&[1], &[9], 3), "names peer 9"),
        (crate::schedule::exchange(&[0], &[1], 3), "as its own peer"),
        (past, "elements 0..4 of a buffer of 3"),
        (
            crate::schedule::exchange(&[1], &[1], 4),
            "buffer of 3 elements",
        ),
    ];
    for (id, (schedule, says)) in bad.into_iter().enumerate() {
        let mut out = Vec::new();
        e.on_request(Duration::ZERO, id as ReqId, run(schedule), &mut out);
        match &out[..] {
            [
                Action::Complete {
                    result: Err(err @ Error::Protocol { rank: 0, .. }),
                    ..
                },
            ] => assert!(err.to_string().contains(says), "{err}"),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(e.failure().is_none());
    assert!(e.outstanding.is_empty() && e.running.is_empty());
    let mut out = Vec::new();
    let fine = crate::schedule::exchange(&[1], &[1], 3);
    e.on_request(Duration::ZERO, 9, run(fine), &mut out);
    assert!(matches!(&out[..], [Action::Send { to: 1, .. }]), "{out:?}");
}

#[test]
fn a_welcome_to_a_rank_outside_the_job_is_refused() {
    let mut e = Engine::new(0, 4, elastic());
    for (id, to) in [(1, 9), (2, 0)] {
        let mut out = Vec::new();
        let welcome = Request::Welcome {
            to,
            data: Payload::Data(vec![1.0]),
            info: Vec::new(),
        };
        e.on_request(Duration::ZERO, id, welcome, &mut out);
        assert!(
            matches!(
                &out[..],
                [Action::Complete {
                    result: Err(Error::Protocol { rank: 0, .. }),
                    ..
                }]
            ),
            "{out:?}"
        );
    }
    assert!(e.failure().is_none());
}

/// What a run of one allreduce over a [`Net`] gave: every rank's result as bits, and the
/// net's counts.
struct FoldRun {
    sums: Vec<Vec<u32>>,
    counts: FoldCounts,
    /// Ranks whose result is one view of a buffer that parts were laid out in.
    joined_in_place: usize,
}

/// One allreduce of `len` rank-dependent values (whose sums round differently in different
/// orders) over `p` ranks, folding parts as they arrive or not, and the transport too late
/// for every fold or not.
fn fold_run(
    p: usize,
    len: usize,
    algorithm: crate::schedule::AllreduceAlgorithm,
    folding: bool,
    too_late: bool,
) -> FoldRun {
    let value = |r: Rank, i: usize| ((i * 7919 + r * 104_729) % 1009) as f32 * 0.013 + 1e-7;
    let mut net = Net::new(p);
    net.too_late = too_late;
    for e in &mut net.engines {
        e.fold_on_arrival(folding);
    }
    let members: Vec<Rank> = (0..p).collect();
    let choice = crate::schedule::AlgorithmChoice {
        algorithm,
        ..Default::default()
    };
    for r in 0..p {
        let schedule = crate::schedule::allreduce(r, &members, len, &choice);
        net.request(
            r,
            1,
            Request::Run(CollectiveRun {
                kind: Kind::Collective,
                seq: 0,
                schedule,
                data: Payload::Data((0..len).map(|i| value(r, i)).collect()),
                weight: 1.0,
                steps: 0,
            }),
        );
    }
    net.pump(10_000);
    let mut joined_in_place = 0;
    let sums: Vec<Vec<u32>> = (0..p)
        .map(|r| match net.take(r, 1) {
            Ok(Response::Data { data, weight, .. }) => {
                assert_eq!(weight, p as f64);
                joined_in_place += usize::from(matches!(data, Payload::Shared(_)));
                data.as_slice().iter().map(|x| x.to_bits()).collect()
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    // Every fold asked for was used or withdrawn, every placement used.
    assert!(net.folds.is_empty(), "{} folds left", net.folds.len());
    FoldRun {
        sums,
        counts: net.counts,
        joined_in_place,
    }
}

#[test]
fn a_part_folded_as_it_arrives_gives_the_bits_of_one_folded_after() {
    // Every part of reduce-scatter + allgather at P = 4 (a quarter) is large enough to fold.
    let len = (1 << 18) + 5;
    for algorithm in [
        crate::schedule::AllreduceAlgorithm::RecursiveDoubling,
        crate::schedule::AllreduceAlgorithm::ReduceScatterAllgather,
    ] {
        let run = |folding, too_late| {
            let r = fold_run(4, len, algorithm, folding, too_late);
            // No phase at P = 4 reads the rest of a folded part's whole right after it.
            let c = r.counts;
            assert_eq!(c.laid_out, 0, "{algorithm:?}");
            (r.sums, c.folded, c.unfolded, c.placed, c.expected)
        };
        let (after, none, _, _, _) = run(false, false);
        let (arriving, folded, withdrawn, placed, expected) = run(true, false);
        let (late, not_folded, all_withdrawn, _, _) = run(true, true);
        assert_eq!((none, not_folded, withdrawn), (0, 0, 0));
        // The allgather's last half, read into place where a rank's phase asked in time;
        // recursive doubling replaces no part.
        let halves =
            usize::from(algorithm == crate::schedule::AllreduceAlgorithm::ReduceScatterAllgather);
        // Every rank says, as a phase starts, that the next one's part will be asked for:
        // recursive doubling's second step; reduce-scatter's second step and the
        // allgather's last half.
        assert_eq!(expected, 4 + 4 * halves, "{algorithm:?}");
        assert!(
            (halves..=4 * halves).contains(&placed),
            "{algorithm:?}: {placed} placed"
        );
        assert!(
            all_withdrawn >= 4,
            "{algorithm:?}: {all_withdrawn} withdrawn"
        );
        assert!(
            after == late,
            "{algorithm:?}: asked to fold too late, the sums differ"
        );
        // At least every rank's first reducing phase (a later one's message may be here
        // before the phase starts, and is then combined whole).
        assert!(
            (4..=4 * 2).contains(&folded),
            "{algorithm:?}: {folded} folded"
        );
        assert!(
            after == arriving,
            "{algorithm:?}: folded on arrival, the sums differ"
        );
        assert!(after.iter().all(|s| s == &after[0]), "{algorithm:?}");
    }
}

#[test]
fn the_halves_of_a_pair_are_reduced_and_gathered_into_one_buffer() {
    // An odd length: the halves differ by one.
    let len = (1 << 18) + 5;
    let algorithm = crate::schedule::AllreduceAlgorithm::ReduceScatterAllgather;
    let after = fold_run(2, len, algorithm, false, false);
    let arriving = fold_run(2, len, algorithm, true, false);
    assert!(after.sums == arriving.sums, "the sums differ");
    assert!(after.sums[0] == after.sums[1]);
    assert_eq!((after.counts.placed, after.joined_in_place), (0, 0));
    // Each rank folds the reduce-scatter's half into a buffer laid out for the whole, and
    // reads the allgather's half into the rest of it, where the peer's half arrives after
    // the ask: the result is that buffer, with nothing copied.
    let c = arriving.counts;
    assert_eq!((c.folded, c.laid_out), (2, 2));
    assert_eq!(c.expected, 2);
    assert!(c.beside >= 1, "{} beside", c.beside);
    assert_eq!(c.beside, c.placed);
    assert_eq!(arriving.joined_in_place, c.beside);
}
