"""Saves PNG screenshots of console pages in headless Chromium
(tests/cluster_suite/cluster_ui.rs; tests/ui/console-screenshots regenerates
the book's images with it).

usage: screenshot.py URL PNG [URL PNG ...]
Prints "saved: PNG <title>" for each page.
"""
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

pairs = sys.argv[1:]
if not pairs or len(pairs) % 2:
    sys.exit("usage: screenshot.py URL PNG [URL PNG ...]")

options = webdriver.ChromeOptions()
for flag in [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
    "--hide-scrollbars",
    # Loopback only: anything else goes to a dead proxy on loopback.
    "--proxy-server=http://127.0.0.1:9", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-domain-reliability", "--no-pings", "--dns-prefetch-disable",
]:
    options.add_argument(flag)
options.binary_location = "/usr/bin/chromium"
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
try:
    for url, png in zip(pairs[0::2], pairs[1::2]):
        driver.get(url)
        # The whole page, as tall as it is (up to a bound).
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(1280, max(600, min(int(height) + 40, 2400)))
        driver.save_screenshot(png)
        print("saved: " + png + " " + driver.title)
finally:
    driver.quit()
