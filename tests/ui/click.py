"""Drives the approvals page in headless Chromium (tests/cluster_suite/cluster_ui.rs).

usage: click.py URL TOKEN BUTTON [SCREENSHOT]
Opens URL, finds the waiting call TOKEN, opens it, clicks the button whose
id is BUTTON (approve, deny, ...). Prints "shown: <ids>" for what the pages
showed, then "after: ok" when the page went back to the list, or
"after: error: <text>" with the page's error message.
"""
import sys

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

url, token, button = sys.argv[1], sys.argv[2], sys.argv[3]
screenshot = sys.argv[4] if len(sys.argv) > 4 else None

options = webdriver.ChromeOptions()
for flag in [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,900",
    # Loopback only: anything else goes to a dead proxy on loopback.
    "--proxy-server=http://127.0.0.1:9", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-domain-reliability", "--no-pings", "--dns-prefetch-disable",
]:
    options.add_argument(flag)
options.binary_location = "/usr/bin/chromium"
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
try:
    driver.get(url)
    links = [a for a in driver.find_elements(By.CSS_SELECTOR, "a.open") if a.text == token]
    if not links:
        print("shown: no " + token + " in " + driver.find_element(By.TAG_NAME, "body").text)
        sys.exit(1)
    links[0].click()
    shown = [i for i in ["tool", "arguments", "conversation", "approve", "deny", "edit", "complete"]
             if driver.find_elements(By.ID, i)]
    print("shown: " + " ".join(shown))
    if screenshot:
        driver.save_screenshot(screenshot)
    driver.find_element(By.ID, button).click()
    # The click posts the form; wait until its answer is on screen: the
    # list again (success) or a page that shows the error. Reading the
    # page before that would take a refusal still loading for a success.
    WebDriverWait(driver, 20).until(
        lambda d: d.find_elements(By.ID, "error")
        or (not d.current_url.endswith("/decide")
            and not d.current_url.endswith("/complete")
            and d.execute_script("return document.readyState") == "complete")
    )
    errors = driver.find_elements(By.ID, "error")
    if errors:
        print("after: error: " + errors[0].text)
    else:
        print("after: ok " + driver.current_url)
finally:
    driver.quit()
