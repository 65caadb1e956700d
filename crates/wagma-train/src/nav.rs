//! A point-goal navigation environment: procedurally generated grid maps with obstacles; the
//! agent sees the obstacles around it and the goal's relative position (like DD-PPO's compass
//! and GPS), moves one cell per step, and an episode ends at the goal or at a step limit, so
//! that the time to collect a fixed number of episodes varies.

use std::collections::VecDeque;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Moves: up, down, left, right.
pub const ACTIONS: usize = 4;
const MOVES: [(i32, i32); ACTIONS] = [(0, -1), (0, 1), (-1, 0), (1, 0)];

/// Settings of the environment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct NavConfig {
    /// Side of the square map.
    pub size: usize,
    /// Share of cells that are obstacles.
    pub density: f64,
    /// Radius of the egocentric view.
    pub view: usize,
}

impl Default for NavConfig {
    fn default() -> Self {
        NavConfig {
            size: 9,
            density: 0.2,
            view: 2,
        }
    }
}

impl NavConfig {
    /// Length of an observation.
    pub fn obs_len(&self) -> usize {
        (2 * self.view + 1).pow(2) + 3
    }
}

/// One episode on one map.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Episode {
    cfg: NavConfig,
    blocked: Vec<bool>,
    /// Geodesic distance of every cell to the goal (`u32::MAX` when unreachable).
    to_goal: Vec<u32>,
    pos: (usize, usize),
    goal: (usize, usize),
    /// Shortest path length from the start.
    pub shortest: usize,
    /// Steps taken.
    pub steps: usize,
    limit: usize,
}

/// What a step returns.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Reward.
    pub reward: f32,
    /// True when the episode ended.
    pub done: bool,
    /// True when it ended at the goal.
    pub success: bool,
}

impl Episode {
    /// A random map and start/goal pair (seeded), with a start at least 3 steps from the goal.
    pub fn generate(cfg: NavConfig, seed: u64) -> Episode {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = cfg.size;
        loop {
            let blocked: Vec<bool> = (0..n * n).map(|_| rng.random_bool(cfg.density)).collect();
            let free: Vec<usize> = (0..n * n).filter(|&i| !blocked[i]).collect();
            if free.len() < 2 {
                continue;
            }
            let goal = free[rng.random_range(0..free.len())];
            let to_goal = bfs(&blocked, n, goal);
            let starts: Vec<usize> = free
                .iter()
                .copied()
                .filter(|&i| to_goal[i] != u32::MAX && to_goal[i] >= 3)
                .collect();
            if starts.is_empty() {
                continue;
            }
            let start = starts[rng.random_range(0..starts.len())];
            let shortest = to_goal[start] as usize;
            return Episode {
                cfg,
                blocked,
                to_goal,
                pos: (start % n, start / n),
                goal: (goal % n, goal / n),
                shortest,
                steps: 0,
                limit: 2 * shortest + 8,
            };
        }
    }

    /// Whether this episode, read back from a checkpoint, fits the environment `cfg`: its map
    /// has `cfg`'s size, the agent and the goal are on it, and its step limit is one a map of
    /// that size gives (so that it ends).
    pub fn fits(&self, cfg: NavConfig) -> bool {
        let n = cfg.size;
        let on_map = |(x, y): (usize, usize)| x < n && y < n;
        self.cfg == cfg
            && self.blocked.len() == n * n
            && self.to_goal.len() == n * n
            && on_map(self.pos)
            && on_map(self.goal)
            && self.limit <= 2 * n * n + 8
            && self.steps <= self.limit
    }

    fn cell(&self, x: i32, y: i32) -> bool {
        let n = self.cfg.size as i32;
        x < 0 || y < 0 || x >= n || y >= n || self.blocked[(y * n + x) as usize]
    }

    fn dist(&self) -> u32 {
        self.to_goal[self.pos.1 * self.cfg.size + self.pos.0]
    }

    /// The observation: obstacles around the agent (1 = blocked or outside), then the goal's
    /// offset and Euclidean distance, divided by the map size.
    pub fn observe(&self, out: &mut Vec<f32>) {
        let r = self.cfg.view as i32;
        let (x, y) = (self.pos.0 as i32, self.pos.1 as i32);
        for dy in -r..=r {
            for dx in -r..=r {
                out.push(f32::from(u8::from(self.cell(x + dx, y + dy))));
            }
        }
        let n = self.cfg.size as f32;
        let gx = (self.goal.0 as f32 - self.pos.0 as f32) / n;
        let gy = (self.goal.1 as f32 - self.pos.1 as f32) / n;
        out.extend_from_slice(&[gx, gy, (gx * gx + gy * gy).sqrt()]);
    }

    /// Takes `action`: a step cost, a reward for getting geodesically closer, a bonus at the
    /// goal.
    pub fn step(&mut self, action: usize) -> Outcome {
        let before = self.dist();
        let (dx, dy) = MOVES[action % ACTIONS];
        let (nx, ny) = (self.pos.0 as i32 + dx, self.pos.1 as i32 + dy);
        if !self.cell(nx, ny) {
            self.pos = (nx as usize, ny as usize);
        }
        self.steps += 1;
        let after = self.dist();
        let success = self.pos == self.goal;
        let done = success || self.steps >= self.limit;
        let reward = -0.01 + 0.1 * (before as f32 - after as f32) + if success { 2.5 } else { 0.0 };
        Outcome {
            reward,
            done,
            success,
        }
    }
}

/// Distances from `from` over free cells (4-neighbourhood).
fn bfs(blocked: &[bool], n: usize, from: usize) -> Vec<u32> {
    let mut d = vec![u32::MAX; n * n];
    let mut q = VecDeque::new();
    d[from] = 0;
    q.push_back(from);
    while let Some(c) = q.pop_front() {
        let (x, y) = ((c % n) as i32, (c / n) as i32);
        for (dx, dy) in MOVES {
            let (nx, ny) = (x + dx, y + dy);
            if nx >= 0 && ny >= 0 && (nx as usize) < n && (ny as usize) < n {
                let i = ny as usize * n + nx as usize;
                if !blocked[i] && d[i] == u32::MAX {
                    d[i] = d[c] + 1;
                    q.push_back(i);
                }
            }
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_greedy_geodesic_walker_succeeds_with_spl_one() {
        for seed in 0..50 {
            let mut e = Episode::generate(NavConfig::default(), seed);
            let shortest = e.shortest;
            assert!(shortest >= 3);
            let outcome = loop {
                let best = (0..ACTIONS)
                    .min_by_key(|&a| {
                        let (dx, dy) = MOVES[a];
                        let (nx, ny) = (e.pos.0 as i32 + dx, e.pos.1 as i32 + dy);
                        if e.cell(nx, ny) {
                            u32::MAX
                        } else {
                            e.to_goal[ny as usize * e.cfg.size + nx as usize]
                        }
                    })
                    .unwrap();
                let o = e.step(best);
                if o.done {
                    break o;
                }
            };
            assert!(outcome.success);
            assert_eq!(e.steps, shortest);
        }
    }

    #[test]
    fn observations_and_limits() {
        let cfg = NavConfig::default();
        let mut e = Episode::generate(cfg, 3);
        let mut obs = Vec::new();
        e.observe(&mut obs);
        assert_eq!(obs.len(), cfg.obs_len());
        // Walking into a wall forever ends the episode at the limit, unsuccessfully.
        let mut last = None;
        for _ in 0..1000 {
            let o = e.step(0);
            if o.done {
                last = Some(o);
                break;
            }
        }
        let o = last.unwrap();
        assert!(o.done);
        assert_eq!(
            Episode::generate(cfg, 3).shortest,
            Episode::generate(cfg, 3).shortest
        );
    }
}
