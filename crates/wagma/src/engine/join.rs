//! Rejoining (elastic mode): a restarted process takes over the rank of one that was declared
//! dead.
//!
//! The joiner announces itself to every peer ([`Request::Announce`]); each living engine
//! notes it as joining ([`EngineStats::joining`]). The compute sides agree on whom to admit
//! at a point of their choosing (a blocking collective among the living), admit them
//! ([`Request::Admit`]) so that every later collective and round includes them, and one of
//! them sends each joiner a welcome ([`Request::Welcome`]): the model to start from and the
//! counters that must match (the number of streams opened, the peers still dead, and the
//! caller's own values). The joiner's compute side waits for it ([`Request::AwaitWelcome`]).
//!
//! [`Request::Announce`]: super::Request::Announce
//! [`Request::Admit`]: super::Request::Admit
//! [`Request::Welcome`]: super::Request::Welcome
//! [`Request::AwaitWelcome`]: super::Request::AwaitWelcome
//! [`EngineStats::joining`]: super::EngineStats::joining

use super::{Action, Engine, ReqId, Response, Time};
use crate::Rank;
use crate::error::{Error, Op};
use crate::payload::Payload;
use crate::transport::{Contribution, Envelope, Kind, Meta, Tag};

/// Step of the control message a restarted rank sends to announce itself.
pub(super) const CONTROL_JOIN: u16 = 3;
/// Step of the control message that admits a joiner and carries its starting state.
pub(super) const CONTROL_WELCOME: u16 = 4;

/// What a joiner receives: the model to start from and the values its peers agreed on.
#[derive(Debug)]
pub struct Welcome {
    /// The rank that sent the welcome.
    pub from: Rank,
    /// The state to start from, as the sender laid it out.
    pub data: Payload,
    /// The sender's values, in order.
    pub info: Vec<u64>,
}

/// A joiner's compute side waiting for its welcome.
pub(super) struct WelcomeWaiter {
    id: ReqId,
    since: Time,
    deadline: Time,
}

/// The header of a welcome travels in the message's contribution list (which every transport
/// already carries): first the number `d` of dead peers, then `d` entries naming them, then the
/// caller's values.
fn encode(dead: &[Rank], info: &[u64]) -> Vec<Contribution> {
    let mut v = Vec::with_capacity(1 + dead.len() + info.len());
    v.push(Contribution {
        rank: 0,
        steps: dead.len() as u64,
    });
    v.extend(dead.iter().map(|&rank| Contribution { rank, steps: 0 }));
    v.extend(info.iter().map(|&steps| Contribution { rank: 0, steps }));
    v
}

fn decode(c: &[Contribution]) -> Option<(Vec<Rank>, Vec<u64>)> {
    let d = usize::try_from(c.first()?.steps).ok()?;
    let end = d.checked_add(1)?;
    let dead = c.get(1..end)?.iter().map(|x| x.rank).collect();
    let info = c.get(end..)?.iter().map(|x| x.steps).collect();
    Some((dead, info))
}

impl Engine {
    /// Joiner: tells every peer that this process has taken over its rank. Until welcomed, it
    /// hears from no one (its peers count it dead), so silence does not make peers dead.
    pub(super) fn announce(&mut self, out: &mut Vec<Action>) {
        self.rejoining = true;
        let me = self.rank;
        for p in (0..self.ranks).filter(|&p| p != me) {
            let env = self.control(CONTROL_JOIN, Meta::default(), Payload::Size(0));
            self.send(p, env, out);
        }
    }

    /// A peer announced that it restarted. Only a peer declared dead can rejoin: the loss of
    /// its old incarnation reaches this rank before the new one's announcement, and an
    /// announcement that arrives after the others admitted it changes nothing.
    pub(super) fn on_join(&mut self, from: Rank) {
        if self.cfg.elastic && self.dead.contains(from) {
            tracing::info!(rank = self.rank, peer = from, "rank {from} asks to rejoin");
            self.joining.insert(from);
        }
    }

    /// Includes `ranks` (announced joiners) in every collective and round from now on. What a
    /// joiner has already sent is kept: peers that admitted it earlier may have welcomed it, and
    /// it may already be in the collective that follows the admission. A joiner this rank has
    /// not heard from yet was still counted alive here only because the loss of its old
    /// incarnation had not reached it; admitting it is the same.
    pub(super) fn admit(&mut self, now: Time, ranks: &[Rank]) -> Result<(), Error> {
        if let Some(&r) = ranks.iter().find(|&&r| r >= self.ranks || r == self.rank) {
            return Err(Error::Protocol {
                rank: self.rank,
                op: Op::Other("admitting a rank"),
                detail: format!("rank {r} is not a peer of this job"),
            });
        }
        for &r in ranks {
            self.dead.remove(r);
            self.departed.remove(r);
            self.joining.remove(r);
            if let Some(l) = self.liveness.as_mut() {
                l.restart(r, now);
            }
            tracing::info!(
                rank = self.rank,
                peer = r,
                "admitted rank {r} back into the job"
            );
        }
        Ok(())
    }

    /// Sends `to` (just admitted) the state to start from, with this engine's counters.
    pub(super) fn welcome(
        &mut self,
        to: Rank,
        data: Payload,
        info: &[u64],
        out: &mut Vec<Action>,
    ) -> Result<(), Error> {
        if to >= self.ranks || to == self.rank {
            return Err(Error::Protocol {
                rank: self.rank,
                op: Op::Other("welcoming a rank"),
                detail: format!("rank {to} is not a peer of this job"),
            });
        }
        let meta = Meta {
            total_len: data.len() as u64,
            aux: self.opened_streams,
            contributions: encode(&self.dead(), info).into(),
            ..Meta::default()
        };
        let env = self.control(CONTROL_WELCOME, meta, data);
        self.send(to, env, out);
        Ok(())
    }

    pub(super) fn on_welcome(&mut self, now: Time, env: &Envelope, out: &mut Vec<Action>) {
        if !self.rejoining {
            tracing::warn!(
                rank = self.rank,
                peer = env.from,
                "ignored a welcome: this rank did not ask to rejoin"
            );
            return;
        }
        let Some((dead, info)) = decode(&env.meta.contributions) else {
            let err = Error::Protocol {
                rank: self.rank,
                op: Op::Other("rejoining"),
                detail: format!("rank {} sent a malformed welcome", env.from),
            };
            self.fail(err, out);
            return;
        };
        self.rejoining = false;
        if let Some(l) = self.liveness.as_mut() {
            for p in 0..self.ranks {
                l.restart(p, now);
            }
        }
        // Streams this rank opens from now on are the ones its peers have open.
        self.opened_streams = env.meta.aux.saturating_sub(1);
        for r in dead {
            self.declare_dead(
                now,
                r,
                "its peers had lost it when they admitted this rank",
                out,
            );
        }
        self.welcome = Some(Box::new(Welcome {
            from: env.from,
            data: env.data.duplicate(),
            info,
        }));
        self.deliver_welcome(out);
    }

    /// Joiner: answers `id` with the welcome once it is here (or fails it at `deadline`).
    pub(super) fn await_welcome(
        &mut self,
        now: Time,
        id: ReqId,
        timeout: std::time::Duration,
        out: &mut Vec<Action>,
    ) {
        self.welcome_waiter = Some(Box::new(WelcomeWaiter {
            id,
            since: now,
            deadline: now.saturating_add(timeout),
        }));
        self.deliver_welcome(out);
    }

    fn deliver_welcome(&mut self, out: &mut Vec<Action>) {
        if self.welcome.is_some()
            && let Some(w) = self.welcome_waiter.take()
            && let Some(welcome) = self.welcome.take()
        {
            self.complete(w.id, Ok(Response::Welcome(*welcome)), out);
        }
    }

    /// Fails the wait for a welcome that did not come in time, or that can no longer come
    /// because every peer has left the job or died.
    pub(super) fn check_welcome(&mut self, now: Time, out: &mut Vec<Action>) {
        let Some(w) = &self.welcome_waiter else {
            return;
        };
        let me = self.rank;
        let nobody = (0..self.ranks)
            .filter(|&p| p != me)
            .all(|p| self.dead.contains(p) || self.departed.contains(p));
        let op = Op::Other("waiting to be admitted back into the job");
        let err = if nobody && self.ranks > 1 {
            Error::PeerLost {
                rank: me,
                peer: if me == 0 { 1 } else { 0 },
                op,
                reason: "every peer has left the job or died".into(),
            }
        } else if now >= w.deadline {
            Error::Timeout {
                rank: me,
                op,
                waited: now.saturating_sub(w.since),
                missing: (0..self.ranks).filter(|&p| p != me).collect(),
            }
        } else {
            return;
        };
        if let Some(w) = self.welcome_waiter.take() {
            self.complete(w.id, Err(err), out);
        }
    }

    /// The welcome wait's deadline, if a joiner waits.
    pub(super) fn welcome_deadline(&self) -> Option<Time> {
        self.welcome_waiter.as_ref().map(|w| w.deadline)
    }

    pub(super) fn control(&self, step: u16, meta: Meta, data: Payload) -> Envelope {
        Envelope {
            from: self.rank,
            tag: Tag {
                kind: Kind::Control,
                seq: 0,
                step,
            },
            meta,
            data,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_welcome_header_round_trips() {
        let c = encode(&[2, 5], &[40, 7, u64::MAX]);
        assert_eq!(decode(&c), Some((vec![2, 5], vec![40, 7, u64::MAX])));
        assert_eq!(decode(&encode(&[], &[])), Some((vec![], vec![])));
        assert_eq!(decode(&c[..2]), None);
        assert_eq!(decode(&[]), None);
        let huge = [Contribution {
            rank: 0,
            steps: u64::MAX,
        }];
        assert_eq!(decode(&huge), None);
    }
}
